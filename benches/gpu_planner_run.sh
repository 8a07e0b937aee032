#!/usr/bin/env bash
# The H200 run behind the restore planner's figures (benches/RESULTS.md §8, README "When a tier pays"), in one
# device call (< 10 min):
#   here:  make gpu-wheel; pip download transformers==5.24.0 and a recent regex into .whl-hf/ (see RESULTS §8)
#   there: bash benches/gpu_planner_run.sh OUTDIR [WINDOWS]
# 1. bench_transformers.py's time-to-first-token rows (one invocation per context and window) (recompute, every page
#    loaded, planned: host, disk, mixed, a disk throttled to 0.3 GB/s) at 8K and 32K, for each KVTier window in
#    WINDOWS (default "2"; "all": every layer resident), then the split curve at 8K with the first window;
#    2. the demo (`python -m kvtier_demo`) on the GPU; 3. the CUDA tests of the transformers cache and the planner.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_planner_run.sh OUTDIR [WINDOWS]}
windows=${2:-2}
. benches/gpu_env.sh
if [ -d .whl-hf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl-hf/*.whl || exit 1
fi
python3 -c "import transformers, kvtier; print('transformers', transformers.__version__, 'kvtier', kvtier.__version__)"
for ctx in 8192 32768; do
  for w in $windows; do
    timeout 240 python3 benches/python/bench_transformers.py --skip-decode --contexts $ctx --window "$w" \
      --out "$out/h200-transformers-ttft-$ctx-w$w.json" > "$out/bench-transformers-$ctx-w$w.log" 2>&1
    echo "bench $ctx window $w exit $?"; tail -6 "$out/bench-transformers-$ctx-w$w.log"
  done
done
w=${windows%% *}
timeout 200 python3 benches/python/probe_split_curve.py --ctx 8192 --window "$w" --label "window $w" \
  --out "$out/h200-split-curve-w$w.json" > "$out/split-curve-w$w.log" 2>&1
echo "split curve exit $?"; tail -10 "$out/split-curve-w$w.log" | cut -c1-250
timeout 150 python3 -m kvtier_demo > "$out/demo.log" 2>&1; echo "demo exit $?"; tail -14 "$out/demo.log"
timeout 150 python3 -m pytest tests/test_restore_planning.py tests/test_transformers.py tests/test_restore_tail.py \
  -m cuda -p no:cacheprovider -q -rs > "$out/pytest-planner-cuda.log" 2>&1; tail -4 "$out/pytest-planner-cuda.log"
