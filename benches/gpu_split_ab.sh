#!/usr/bin/env bash
# A split restore's execution, A/B in one device call: the split curve at 8K (benches/python/probe_split_curve.py:
# heads of 0..128 pages forced, each the median of 3 restores) with this tree's wheel and with an earlier
# commit's Python code over the same native library (the native module only gained functions since), in the
# order before, after, before, after.
#   here:  make gpu-wheel; git archive REF python/kvtier > .wheel-old/old-python.tar; .whl-hf/ as for
#          gpu_planner_run.sh
#   there: [WINDOW=all] [HEADS=84,92] [ROUNDS=2] bash benches/gpu_split_ab.sh OUTDIR [CTX]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_split_ab.sh OUTDIR [CTX]}
ctx=${2:-8192}
. benches/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl-hf/*.whl || exit 1
old=$(mktemp -d /tmp/kvtier-old.XXXX)
cp -r "$site"/. "$old"/
tar -xf .wheel-old/old-python.tar -C "$old" && cp -r "$old"/python/kvtier/. "$old"/kvtier/ && rm -rf "$old"/python
heads=()
[ -n "${HEADS:-}" ] && heads=(--heads "$HEADS")
for round in $(seq "${ROUNDS:-2}"); do
  for side in before after; do
    path=$site; [ $side = before ] && path=$old
    PYTHONPATH=$path timeout 200 python3 benches/python/probe_split_curve.py --ctx "$ctx" --label "$side" \
      --window "${WINDOW:-2}" "${heads[@]}" \
      --out "$out/h200-split-curve-$side-$round.json" > "$out/split-curve-$side-$round.log" 2>&1
    echo "$side $round exit $?"; tail -3 "$out/split-curve-$side-$round.log" | cut -c1-300
  done
done
