#!/usr/bin/env bash
# The H200 run behind benches/results/h200-transfer.* (issue #14), in one device call (< 10 min):
#   here:  make gpu-wheel; ../shared/anchors/fetch_wheels.sh .whl-anchor; cp ../shared/anchors/*.py .anchor/
#   there: bash benches/gpu_transfer_run.sh OUTDIR
# (the README blocks run in CI: one needs Mooncake, which the GPU machine lacks)
# 1. every transfer-bench cell (A/B/C/D x 16/64/256/1024 pages x both backends x side/default stream x CPU/CUDA
#    indices, and the kernel block sweep); 2. the CUDA tests; 3. SGLang's JIT kernels (the anchor) in the same
#    session; count_round_trip and probe_host_cost (host time of a per-layer call); 4. D alone at 1024 pages (is the kernel's miss there the run order?); 5. geometry E (48/32 KiB
#    chunks) on the copy engine and as kernels (the edge of KVTIER_DIRECT_KERNEL_BELOW_KB).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_transfer_run.sh OUTDIR [1|2]}  # part 1 or 2 (each under 10 min), or both
part=${2:-all}
tmp=$(mktemp -d)
. benches/gpu_env.sh
bench() { timeout "$1" python3 -m kvtier_bench transfer --no-overlap --reps 5 --streams side --indices cpu "${@:3}" --out "$tmp/$2" > "$tmp/$2.log" 2>&1; cp "$tmp/$2/transfer.json" "$out/$2.json"; }
if [ "$part" != 2 ]; then
bench 330 transfer --geoms A,B,C,D --pages 16,64,256,1024 --streams side,default --indices cpu,cuda
cp "$tmp/transfer/transfer.md" "$out/transfer.md"; tail -2 "$tmp/transfer.log"
timeout 150 python3 -m pytest tests/test_buffer.py tests/test_default_stream_cuda.py tests/test_pools_cuda.py tests/test_pools_mla.py tests/test_route_cuda.py tests/test_transfer_cuda.py tests/test_overlap.py tests/test_kernels_abi.py tests/test_warm_load.py tests/test_engine_lifetime.py tests/test_round_trip_calls.py -p no:cacheprovider -q -rs 2>&1 | tail -25 > "$out/pytest-cuda.log"; tail -2 "$out/pytest-cuda.log"
# one new page's round trip: kvtier Python functions and native calls on the CUDA path, side and default stream
for flag in "" --default-stream; do timeout 60 python3 benches/python/count_round_trip.py cuda $flag --out "$out/count-round-trip.jsonl" > "$tmp/count.log" 2>&1; tail -8 "$tmp/count.log"; done
fi
if [ "$part" != 1 ]; then
timeout 90 python3 benches/python/probe_host_cost.py --out "$tmp/probe" > "$tmp/probe.log" 2>&1; cp "$tmp"/probe/*.json "$out/" 2>/dev/null; tail -3 "$tmp/probe.log"
bench 40 d1024 --geoms D --pages 1024 --no-sweep
bench 50 e-dma --geoms E --pages 64,256 --no-sweep
KVTIER_DIRECT_KERNEL_BELOW_KB=64 bench 50 e-kernel --geoms E --pages 64,256 --no-sweep
if [ -d .whl-anchor ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/anc .whl-anchor/*.whl
  mkdir -p "$tmp/anc"; OUT="$tmp/anc" PYTHONPATH="/tmp/anc:$PYTHONPATH" timeout 120 python3 .anchor/sglang_hicache_anchor.py > "$tmp/anc.log" 2>&1
  cp "$tmp"/anc/*.json "$out/sglang-anchor.json"; tail -2 "$tmp/anc.log"
fi
# the GPU soak on the final engine: 2 processes x 4 threads of backups, loads and store traffic on their streams
timeout 80 python3 tests/soak/soak.py --seconds 40 --procs 2 --threads 4 --device cuda --out "$out/soak-cuda.json" > "$tmp/soak.log" 2>&1; tail -2 "$tmp/soak.log"
fi
