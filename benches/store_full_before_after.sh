#!/usr/bin/env bash
# The store_full bench (benches/store_full.rs) of an earlier commit and of this tree, alternated in one run
# on one disk:
#
#   benches/store_full_before_after.sh REF [ROUNDS] [DIR] [-- BENCH ARGS]
#
# Builds REF's kvtier-core with this tree's benches/ (a git worktree under a temp dir, its own cargo target;
# the bench only uses PageStore::open, put and stats), builds this tree's, then runs both ROUNDS times
# (default 1) in turn on a scratch store under DIR (default ./benches; the store is removed after each
# run). BENCH ARGS go to both (default: 1,000,000 pages of K 2 KiB + V 2 KiB, batches of 1,024, 2 GiB).
# KVTIER_BEFORE_TARGET: a cargo target dir for REF's build, kept between runs (its dependencies then build once).
# Prints each run and writes benches/results/<machine>-store-full-before-after.json (one JSON line per run).
set -euo pipefail
ref=${1:?usage: $0 REF [ROUNDS] [DIR] [-- BENCH ARGS]}
rounds=${2:-1}
dir=${3:-$PWD/benches}
shift $(( $# < 3 ? $# : 3 ))
[ "${1:-}" = "--" ] && shift
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/src" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add -f "$tmp/src" "$ref" >/dev/null
rm -rf "$tmp/src/benches" && cp -r benches "$tmp/src/benches"
build() { # $1: source tree, $2: target dir; prints the bench binary
  (cd "$1" && CARGO_TARGET_DIR="$2" cargo build -q --release -p kvtier-bench --bench store_full \
    --message-format=json | sed -n 's/.*"executable":"\([^"]*store_full[^"]*\)".*/\1/p' | tail -1)
}
before=$(build "$tmp/src" "${KVTIER_BEFORE_TARGET:-$tmp/target}")
after=$(build "$PWD" "${CARGO_TARGET_DIR:-$PWD/target}")
out=benches/results/${KVTIER_MACHINE:-cpu}-store-full-before-after.json
: > "$out"
for i in $(seq "$rounds"); do
  for v in before after; do
    bin=$before; [ $v = after ] && bin=$after
    echo "== round $i: $v ($([ $v = before ] && echo "$ref" || git rev-parse --short HEAD))" >&2
    "$bin" --dir "$dir/kvtier-store-full.$$" "$@" | tee "$tmp/run.txt" >&2
    printf '{"version":"%s","round":%d,"result":%s}\n' "$v" "$i" "$(tail -1 "$tmp/run.txt")" >> "$out"
  done
done
echo "results in $out" >&2
