#!/usr/bin/env bash
# Transfer diagnostics on a GPU machine (no Rust toolchain needed there):
#   here:   make gpu-wheel
#   there:  bash benches/gpu_probe.sh [OUTDIR]
# 1. the CUDA transfer tests (correctness gate), 2. kvtier_bench.transfer_probe (kernel variants, launch
# cost, copy-engine cost per chunk, small loads, staged backups), 3. Nsight Compute on the kernel backend's load and backup.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-results}}
mkdir -p "$out"
. benches/gpu_env.sh
rc=0
timeout "${PROBE_TEST_S:-200}" python3 -m pytest tests/test_transfer_cuda.py tests/test_pools_cuda.py tests/test_overlap.py \
  -p no:cacheprovider -q -x 2>&1 | tail -40 > "$out/pytest.log" || rc=1
tail -3 "$out/pytest.log"
timeout "${PROBE_S:-270}" python3 -m kvtier_bench.transfer_probe --out "$out" --only "${PROBE_PARTS:-kernel,launch,direct,small,staged,direct_geoms}" \
  2>&1 | tee "$out/probe.log" || rc=1
if command -v ncu >/dev/null; then
  ncu --query-metrics --chip gh100 > "$out/ncu-metrics.txt" 2>&1
  m=$(grep -oE '^pcie__[a-z_]+' "$out/ncu-metrics.txt" | sort -u | sed 's/$/.sum/' | paste -sd, -)
  # warm-up: 3 x (96 load launches + 2 backup launches) = 294; then profile one load launch and both backups
  for what in "294 1 load" "390 2 backup"; do
    set -- $what
    timeout 120 ncu --clock-control none -k regex:_rows_kernel --launch-skip "$1" --launch-count "$2" --set detailed \
      ${m:+--metrics "$m"} python3 -m kvtier_bench.transfer_probe --ncu > "$out/ncu-$3.txt" 2>&1 || rc=1
    grep -E "Duration|Memory Throughput|pcie__|Achieved Occupancy|Registers Per|L2 .*sysmem|Warp Cycles Per Issued|Stall" "$out/ncu-$3.txt" | head -30
  done
fi
exit $rc
