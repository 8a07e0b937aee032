#!/usr/bin/env bash
# SGLang's own HiCacheController over kvtier and over HiCacheFile on a GPU (benches/python/sglang_controller.py
# --device cuda): device pool on the GPU, SGLang's host pool and transfers (its JIT HiCache kernels with
# --io-backend kernel; the direct ops through kvtier's stand-in for the compiled sgl_kernel, named in each JSON
# line), each configuration in its own process under a time cap; then the CUDA-marked controller test.
#   there: bash benches/gpu_sglang_controller.sh OUTDIR [SECONDS]   (with kvtier's and .whl-sg's wheels on PYTHONPATH)
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_sglang_controller.sh OUTDIR [SECONDS]}
mkdir -p "$out"
end=$((SECONDS + ${2:-300}))
S=benches/python/sglang_controller.py
python3 -m pytest tests/test_sgl_kernel_standin.py -q -p no:cacheprovider 2>&1 | tail -2
for cfg in "mha direct" "asym direct" "mha kernel" "mla direct" "mha direct file" "mla kernel" "mha kernel file"; do
  set -- $cfg
  left=$((end - SECONDS))
  [ "$left" -lt 45 ] && { echo "skip $cfg (${left}s left)"; continue; }
  n="sglang-$1-$2${3:+-$3}"
  timeout $((left < 200 ? left : 200)) python3 $S --device cuda --model "$1" --io-backend "$2" --backend "${3:-kvtier}" \
    --requests 16 --pages 32 --no-planner --stall-s 150 > "$out/$n.json" 2> "$out/$n.err"
  echo "$n rc=$?"; tail -c 900 "$out/$n.json"; echo
done
left=$((end - SECONDS))
[ "$left" -gt 60 ] && timeout "$left" python3 -m pytest tests/test_sglang_controller.py -m cuda -p no:cacheprovider -q -rs 2>&1 | tail -4
exit 0
