#!/usr/bin/env bash
# The H200 run of the kernel route's warm per-layer load and of the small-page per-layer profile (issue #30),
# in one device call of at most 8 minutes:
#   here:  make gpu-wheel
#   there: bash benches/gpu_route_run.sh OUTDIR
# 1. the CUDA tests of the route, the transfer engine, the warm per-layer load and default-stream callers;
# 2. the transfer bench's per-layer cells: A, B, C, D x 16 and 64 pages x side and default stream x CPU and
#    CUDA indices (OUTDIR/transfer/transfer.{json,md}; each cell is also a JSON line of bench-transfer.log);
# 3. benches/python/probe_layer_calls.py: where a 16- and 64-page per-layer call's and LayerLoader load's
#    time goes (OUTDIR/probe-layer-calls.json, rewritten after each geometry);
# 4. with what is left: the round trip's call counts, the kernels' launch ABI and LayerLoader's overlap tests.
# Every step runs under its own timeout, capped by what is left of the budget (GPU_ROUTE_BUDGET_S, default
# 460 s); a step that fails or times out is recorded and the next one still runs. OUTDIR/steps.tsv gets one
# line per step as it ends (name, exit status: 124 = timed out, seconds), its log is OUTDIR/<step>.log.
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_route_run.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 1
budget=${GPU_ROUTE_BUDGET_S:-460}
. benches/gpu_steps.sh

# the wheels built by `make gpu-wheel` into a temporary target (gpu_env.sh exits when they do not install)
printf 'install\tstarted\t0\n' >> "$out/steps.tsv"
. benches/gpu_env.sh
printf 'install\t0\t%s\n' "$(( $(date +%s) - t0 ))" >> "$out/steps.tsv"
step env 30 python3 -c "import kvtier, torch, triton; print('kvtier', kvtier.__version__, kvtier.__file__); \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1

step pytest-route-cuda 130 python3 -m pytest tests/test_route_cuda.py tests/test_transfer_cuda.py tests/test_warm_load.py \
  tests/test_warm_kernel_route.py \
  tests/test_default_stream_cuda.py -p no:cacheprovider -q -rs --junitxml "$out/pytest-route-cuda.xml"
step bench-transfer 160 python3 -m kvtier_bench transfer --no-overlap --no-sweep --reps 5 --geoms A,B,C,D \
  --pages 16,64 --streams side,default --indices cpu,cuda --out "$out/transfer"
step probe-layer-calls 150 python3 benches/python/probe_layer_calls.py --out "$out/probe-layer-calls.json"
# what is left of the budget: the round trip's native calls and Python functions on CUDA (the engine's
# settings must stay plain attribute reads), the kernels' launch ABI and LayerLoader's overlap
step pytest-round-trip 90 python3 -m pytest tests/test_round_trip_calls.py tests/test_kernels_abi.py tests/test_overlap.py \
  -p no:cacheprovider -q -rs --junitxml "$out/pytest-round-trip.xml"
