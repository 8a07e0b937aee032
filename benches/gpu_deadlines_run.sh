#!/usr/bin/env bash
# The deadlines on the H200 machine, in one device call:
#   here:  make gpu-wheel; transformers==5.24.0 and regex py3.12 wheels in .whl-hf/
#   there: bash benches/gpu_deadlines_run.sh OUTDIR [LOOPS]
# 1. every CUDA test (benches/gpu_cuda_tests.sh) into OUTDIR/cuda/;
# 2. the CUDA stall test of a split's tail LOOPS times (default 10), every thread's stack on a hang, into
#    OUTDIR/tail-stall.log;
# 3. bench_staged_batches.py (staged against zero-copy batches, the disk's and memory's ceilings) at two page
#    sizes into OUTDIR/staged-*.json;
# 4. bench_transformers.py at 8K, window 2 (time to first token against recompute, deadlines on by default)
#    into OUTDIR/transformers-8k.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_deadlines_run.sh OUTDIR [LOOPS]}
loops=${2:-10}
mkdir -p "$out"
rc=0
bash benches/gpu_cuda_tests.sh "$out/cuda" || rc=1
. benches/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl-hf/*.whl || exit 1
for i in $(seq "$loops"); do
  echo "== run $i" >> "$out/tail-stall.log"
  python3 -m pytest -p no:cacheprovider -q -x "tests/test_restore_tail.py::test_a_tail_read_from_a_stalled_disk_gives_recomputings_tokens[2-cuda]" \
    >> "$out/tail-stall.log" 2>&1 || { rc=1; echo "== run $i FAILED" >> "$out/tail-stall.log"; }
done
grep -c " passed" "$out/tail-stall.log" > "$out/tail-stall-passed.txt"
for tokens in 16 64; do
  python3 benches/python/bench_staged_batches.py --pages 128 --page-tokens "$tokens" --rounds 5 \
    > "$out/staged-$tokens.json" 2> "$out/staged-$tokens.err" || rc=1
done
python3 benches/python/bench_transformers.py --skip-decode --contexts 8192 --window 2 --out "$out/transformers-8k.json" \
  > "$out/transformers-8k.log" 2> "$out/transformers-8k.err" || rc=1
exit $rc
