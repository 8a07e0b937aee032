#!/usr/bin/env bash
# What integrity costs the page store: benches/integrity.rs built twice — as always (every object checksummed
# on put, verified on get) and with `--cfg kvtier_bench_unverified` (no checksum; its own target directory, so
# no other build ever sees that flag) — and run alternated on one disk:
#
#   benches/integrity_ab.sh [ROUNDS] [DIR] [-- BENCH ARGS]
#
# ROUNDS (default 3) runs of each, in turn (which build goes first alternates); DIR: the disk to measure
# (default ./benches; each run's stores go in a directory of their own under it, removed after the run).
# Prints both builds' lines and, per case, the medians over the rounds and what verification costs (the
# median over rounds of 1 - verified / unverified); writes benches/results/${KVTIER_MACHINE:-cpu}-integrity.json
# (one JSON line per run, then the summary) once every run is done. RUSTFLAGS set by the caller go to both.
# INTEGRITY_BINS=DIR runs DIR/verified and DIR/unverified instead of building (copied from a machine with Rust).
set -euo pipefail
cd "$(dirname "$0")/.."
pos=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do pos+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
rounds=${pos[0]:-3}
dir=${pos[1]:-$PWD/benches}
case $rounds in ''|*[!0-9]*|0) echo "ROUNDS must be a positive number, got '$rounds'" >&2; exit 2;; esac
build() { # $1: target dir; prints the bench binary (RUSTFLAGS as the caller sets them)
  CARGO_TARGET_DIR="$1" cargo build -q --release -p kvtier-bench --bench integrity --message-format=json |
    sed -n 's/.*"executable":"\([^"]*integrity[^"]*\)".*/\1/p' | tail -1
}
if [ -n "${INTEGRITY_BINS:-}" ]; then
  # a machine without Rust (the GPU machine): both builds made elsewhere, `$INTEGRITY_BINS/{verified,unverified}`
  verified=$INTEGRITY_BINS/verified unverified=$INTEGRITY_BINS/unverified
  [ -x "$verified" ] && [ -x "$unverified" ] || { echo "INTEGRITY_BINS: no verified and unverified in $INTEGRITY_BINS" >&2; exit 2; }
else
  verified=$(build "${CARGO_TARGET_DIR:-$PWD/target}")
  unverified=$(RUSTFLAGS="${RUSTFLAGS:-} --cfg kvtier_bench_unverified" build "${KVTIER_UNVERIFIED_TARGET:-$PWD/target-unverified}")
fi
final=benches/results/${KVTIER_MACHINE:-cpu}-integrity.json
tmp=$(mktemp)
out=$(mktemp)
trap 'rm -f "$tmp" "$out"; rm -rf "$dir/kvtier-integrity.$$"' EXIT
for i in $(seq "$rounds"); do
  order="$verified $unverified"
  [ $((i % 2)) = 0 ] && order="$unverified $verified"
  for bin in $order; do
    echo "== round $i: $([ "$bin" = "$verified" ] && echo verified || echo unverified)" >&2
    "$bin" --dir "$dir/kvtier-integrity.$$" "$@" | tee "$tmp" >&2
    printf '{"round":%d,"result":%s}\n' "$i" "$(tail -1 "$tmp")" >> "$out"
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in runs:
    for c in r["result"]["cases"]:
        k = (c["object_bytes"], c["objects"], r["result"]["verified"])
        by.setdefault(k, []).append(c)
rows = []
print(f"{'case':>14} {'put verified':>13} {'unverified':>11} {'cost':>6} {'get verified':>13} {'unverified':>11} {'cost':>6} {'crc32c/core':>12} {'crate/core':>11}")
for size, n in sorted({(k[0], k[1]) for k in by}):
    v, u = by[(size, n, True)], by[(size, n, False)]
    med = lambda cs, f: statistics.median(c[f] for c in cs)
    pv, pu, gv, gu = med(v, "put_gbps"), med(u, "put_gbps"), med(v, "get_gbps"), med(u, "get_gbps")
    crc = med(v, "crc32c_gbps_one_core")
    crate = med(v, "crc32c_crate_gbps_one_core") if all("crc32c_crate_gbps_one_core" in c for c in v) else None
    # each round's pair (verified, then unverified, back to back) gives one cost; their median and range
    paired = {f: sorted(1 - a[f] / b[f] for a, b in zip(v, u)) for f in ("put_gbps", "get_gbps")}
    row = dict(object_bytes=size, objects=n, put_verified=pv, put_unverified=pu,
               put_cost=statistics.median(paired["put_gbps"]), put_cost_range=[paired["put_gbps"][0], paired["put_gbps"][-1]],
               get_verified=gv, get_unverified=gu,
               get_cost=statistics.median(paired["get_gbps"]), get_cost_range=[paired["get_gbps"][0], paired["get_gbps"][-1]],
               crc32c_gbps_one_core=crc, crc32c_crate_gbps_one_core=crate)
    rows.append(row)
    print(f"{size >> 10:>6} KiB x {n:<3} {pv:>9.2} GB/s {pu:>6.2} GB/s {100 * row['put_cost']:>5.1f}% "
          f"{gv:>9.2} GB/s {gu:>6.2} GB/s {100 * row['get_cost']:>5.1f}% {crc:>7.1f} GB/s {crate or 0:>6.1f} GB/s")
print("cost: the median over rounds of 1 - verified / unverified, each round's two runs back to back")
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"summary": rows, "rounds": len(runs) // 2}) + "\n")
PY
cp "$out" "$final"
echo "results in $final" >&2
