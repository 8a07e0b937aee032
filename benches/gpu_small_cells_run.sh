#!/usr/bin/env bash
# The H200 run behind issue #30's small cells against thread blocks and lanes (benches/RESULTS.md §2, "Small
# cells: blocks and lanes") and the CUDA tests of the code it ran, in one device call of at most 9 minutes:
#   here:  make gpu-wheel; transformers==5.24.0 and regex wheels in .whl-hf/ (RESULTS §8)
#   there: bash benches/gpu_small_cells_run.sh OUTDIR
# 1. the CUDA tests of the transfer path, and of the restore (planner, transformers cache, tail reads: pages of
#    a few MiB through the page store's two-pass read);
# 2. the transfer bench (`python -m kvtier_bench transfer`) for A and C at 16 and 64 pages, side and default
#    stream, CPU indices, once per setting of KVTIER_KERNEL_BLOCKS (16, 32, 64) and KVTIER_TRANSFER_LANES (2, 1),
#    the default setting first and last (how much one run scatters); each into OUTDIR/b<blocks>-l<lanes>[-again]/.
# Steps as in gpu_steps.sh (OUTDIR/steps.tsv, OUTDIR/<step>.log); budget GPU_SMALL_BUDGET_S (default 520 s).
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_small_cells_run.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
budget=${GPU_SMALL_BUDGET_S:-520}
. benches/gpu_steps.sh
. benches/gpu_env.sh
if [ -d .whl-hf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl-hf/*.whl || exit 1
fi
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
junit() { echo "--junitxml=$out/$1.xml"; }
step pytest-transfer-cuda 150 python3 -m pytest tests/test_buffer.py tests/test_default_stream_cuda.py \
  tests/test_engine_lifetime.py tests/test_fuzz_transfer.py tests/test_guards.py tests/test_kernels_abi.py \
  tests/test_overlap.py tests/test_pools_cuda.py tests/test_pools_mla.py tests/test_round_trip_calls.py \
  tests/test_route_cuda.py tests/test_tier_interface.py tests/test_transfer_cuda.py tests/test_warm_kernel_route.py \
  tests/test_warm_load.py -m cuda -p no:cacheprovider -q -rs "$(junit pytest-transfer-cuda)"
step pytest-restore-cuda 150 python3 -m pytest tests/test_restore_planning.py tests/test_transformers.py \
  tests/test_restore_tail.py tests/test_restore_tail_adversarial.py -m cuda -p no:cacheprovider -q -rs \
  "$(junit pytest-restore-cuda)"
for setting in 16-2 32-2 64-2 16-1 32-1 16-2-again; do
  IFS=- read -r blocks lanes again <<< "$setting"
  KVTIER_KERNEL_BLOCKS=$blocks KVTIER_TRANSFER_LANES=$lanes step "bench-$setting" 75 python3 -m kvtier_bench \
    transfer --no-overlap --no-sweep --reps 5 --geoms A,C --pages 16,64 --streams side,default --indices cpu \
    --out "$out/b$blocks-l$lanes${again:+-$again}"
done
