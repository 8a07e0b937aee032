#!/usr/bin/env bash
# The store bench of an earlier commit and of this tree, alternated in one run on one disk:
#
#   benches/store_before_after.sh REF [ROUNDS] [DIR]
#
# Builds REF's wheel (a git worktree under a temp dir, its own cargo target), installs it with --target
# into a temp dir, then runs this checkout's store bench (`python -m kvtier_bench store --reps 3`, the same bench
# code for both) ROUNDS times (default 3) against REF's kvtier and against this tree's .venv build in turn, in a scratch folder under DIR (default ./benches; pick one on the disk to
# measure; the folder is removed at the end). Prints the
# per-round figures and the medians; writes benches/results/<machine>-store-before-after.json.
set -euo pipefail
ref=${1:?usage: $0 REF [ROUNDS] [DIR]}
rounds=${2:-3}
dir=${3:-$PWD/benches}/kvtier-before-after.$$
py=$PWD/.venv/bin/python
benches_py=$PWD/benches/python
test -x "$py" || { echo "run 'make build' first" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/src" >/dev/null 2>&1 || true; rm -rf "$tmp" "$dir"' EXIT
git worktree add -f "$tmp/src" "$ref" >/dev/null
(cd "$tmp/src" && CARGO_TARGET_DIR="$tmp/target" "$(dirname "$py")/maturin" build --release -q -o "$tmp/wheel")
"$py" -m pip install -q --no-deps --target "$tmp/old" "$tmp"/wheel/*.whl
for i in $(seq "$rounds"); do
  for v in before after; do
    rm -rf "$dir" && mkdir -p "$dir"
    if [ $v = before ]; then pp="$tmp/old"; else pp=""; fi
    # KVTIER_BENCH_ARGS: more options for both (e.g. "--cases small" to repeat one case more often)
    # shellcheck disable=SC2086
    (cd "$tmp" && PYTHONPATH="${pp:+$pp:}$benches_py" "$py" -m kvtier_bench store --dir "$dir" --reps 3 --out "$tmp/$v-$i" ${KVTIER_BENCH_ARGS:-} >/dev/null)
    echo "round $i: $v done" >&2
  done
done
machine=${KVTIER_MACHINE:-cpu}
"$py" - "$tmp" "$rounds" "$ref" "$machine" "${KVTIER_RESULT_NAME:-}" <<'EOF'
import json, statistics, subprocess, sys, time
tmp, rounds, ref, machine = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


def summarize(rows):
    """Medians of GB/s and of % of the same run's ceiling, before and after, per case and direction."""
    med = {}
    for case in sorted({r["case"] for r in rows}):
        for d in ("write", "read"):
            def pick(v, pct):
                xs = [r[f"kvtier_{d}_GBps"] / (r[f"ceiling_{d}_GBps"] if pct else 1) * (100 if pct else 1)
                      for r in rows if r["case"] == case and r["version"] == v]
                return round(statistics.median(xs), 3)
            b, a, bp, ap = pick("before", 0), pick("after", 0), pick("before", 1), pick("after", 1)
            med[f"{case}.{d}"] = dict(before_GBps=b, after_GBps=a, change_pct=round(100 * (a / b - 1), 1),
                                      before_pct_of_ceiling=bp, after_pct_of_ceiling=ap)
            print(f"{case:6} {d:5} before {b:6.3f} GB/s ({bp:5.1f}% of ceiling)  after {a:6.3f} GB/s "
                  f"({ap:5.1f}%)  {100 * (a / b - 1):+5.1f}%")
    return med

rows = []
for v in ("before", "after"):
    for i in range(1, rounds + 1):
        d = json.load(open(f"{tmp}/{v}-{i}/store.json"))
        for r in d["rows"]:
            rows.append(dict(version=v, round=i, fs=d["fs"], **{k: r[k] for k in (
                "case", "ceiling_write_GBps", "kvtier_write_GBps", "ceiling_read_GBps", "kvtier_read_GBps", "bit_exact")}))
med = summarize(rows)
here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
out = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), before=ref, after=f"{here} + working tree", rounds=rounds,
           medians=med, rows=rows)
name = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else "store-before-after"
json.dump(out, open(f"benches/results/{machine}-{name}.json", "w"), indent=1)
EOF
