#!/usr/bin/env bash
# Every CUDA-marked test of the suite on a GPU machine, plus the CPU tests that depend on the machine's CPU
# (the checksum's vector path; the page store's put and verified get; native calls off the main thread), in one
# device call:
#   here:  make gpu-wheel; transformers==5.24.0 and regex py3.12 wheels in .whl-hf/ (the transformers tests)
#   there: bash benches/gpu_cuda_tests.sh OUTDIR
# Writes OUTDIR/pytest-cuda.log, OUTDIR/pytest-cpu.log, OUTDIR/machine.txt (GPU, CPU model and flags).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_cuda_tests.sh OUTDIR}
mkdir -p "$out"
. benches/gpu_env.sh
if [ -d .whl-hf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl-hf/*.whl || exit 1
fi
{ nvidia-smi -L; lscpu | grep -E 'Model name|^CPU\(s\)'; grep -o -w -E 'avx512f|vpclmulqdq|sse4_2' /proc/cpuinfo | sort | uniq -c; } > "$out/machine.txt" 2>&1
rc=0
# (the modules that import SGLang or vLLM at the top hold no CUDA test; those packages are CI's, not the GPU machine's)
skip=()
for m in sglang sglang_v2 sglang_v2_faults vllm mooncake_sglang store_paths tenants_engines tenants_vllm engine_deadlines metrics_endpoint; do
  skip+=("--ignore=tests/test_$m.py")
done
python3 -m pytest tests -m cuda -p no:cacheprovider -q -rs --continue-on-collection-errors "${skip[@]}" 2>&1 | tee "$out/pytest-cuda.log" | tail -5 || rc=1
grep -q " passed" "$out/pytest-cuda.log" && ! grep -q -E " (failed|error)" "$out/pytest-cuda.log" || rc=1
python3 -m pytest tests/test_checksum.py tests/test_store.py tests/test_store_layers_first.py tests/test_native_calls.py -p no:cacheprovider \
  -q -rs 2>&1 | tee "$out/pytest-cpu.log" | tail -3
grep -q " passed" "$out/pytest-cpu.log" && ! grep -q -E " (failed|error)" "$out/pytest-cpu.log" || rc=1
exit $rc
