#!/usr/bin/env bash
# Runs on a GPU machine that has Python >= 3.11, torch and pytest but no Rust toolchain:
#   here:   make gpu-wheel            (builds the abi3 wheel into .wheel/ and test wheels into .whl/)
#   there:  bash benches/gpu_check.sh [OUTDIR]
# Installs the wheel into a temporary target (nothing system-wide), runs the whole pytest suite (the CUDA
# tests included; the SGLang and vLLM conformance tests need those packages and run in CI instead) and the GPU benches, and writes logs and JSON into OUTDIR (default ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-results}}
mkdir -p "$out"
. benches/gpu_env.sh
python3 -c "import kvtier, torch; print('kvtier', kvtier.__version__, 'from', kvtier.__file__, '| torch', torch.__version__, torch.cuda.get_device_name())"
rc=0
python3 -m pytest tests -p no:cacheprovider -q -rs --ignore=tests/test_sglang.py --ignore=tests/test_sglang_v2.py --ignore=tests/test_vllm.py 2>&1 | tee "$out/pytest.log" || rc=1
python3 -m kvtier_demo 2>&1 | tee "$out/demo.log" || rc=1
for b in ${KVTIER_GPU_BENCHES:-pin transfer}; do
  python3 "benches/python/bench_$b.py" --out "$out" 2>&1 | tee "$out/bench_$b.log" || rc=1
done
exit $rc
