# Sourced by the GPU scripts (gpu_check.sh, gpu_probe.sh): installs the wheels built here by `make gpu-wheel`
# (.wheel/ and .whl/) into a temporary target directory (nothing system-wide) and points PYTHONPATH at it, and at
# the checkout's benches and demo (benches/python: kvtier_bench; examples: kvtier_demo; the wheel holds neither).
site=$(mktemp -d /tmp/kvtier-site.XXXX)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .wheel/*.whl .whl/*.whl || exit 1
# the checkout's Python over the wheel's (a wheel older than the last Python edit still runs today's Python; the
# native core is the wheel's: rebuild it after a Rust change)
(cd python && find kvtier -name '*.py' -exec cp --parents {} "$site/" \;) || exit 1
export PYTHONPATH="$site:$PWD/benches/python:$PWD/examples" PYTHONUNBUFFERED=1
