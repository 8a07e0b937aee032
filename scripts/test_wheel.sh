#!/usr/bin/env bash
# The installed experience without torch: build the abi3 wheel, install it with pip into a fresh virtualenv
# (no torch, nothing from the repository on the path), and run what a storage host runs: `kvtier --help`,
# `--version`, `inspect`, `stats` and `verify` on a store, and `import kvtier` with a clear error where torch
# is needed. Usage: scripts/test_wheel.sh [PYTHON]  (run by `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
work=$(mktemp -d /tmp/kvtier-wheel-test.XXXX)
trap 'rm -rf "$work"' EXIT
.venv/bin/maturin build --release -q -o "$work/dist" 2>&1 | grep -v "^📦\|^🐍\|^🔗\|^📡" || true
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-index --no-deps "$work"/dist/kvtier-*.whl
# a small store written by the development environment (which has torch)
"$py" - "$work/store" <<'PY'
import sys, torch, kvtier
dp = kvtier.DeviceKVPool(64, 16, 2, 2, 64, 64, torch.bfloat16, "cpu")
hp = kvtier.host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
with kvtier.PageStore(sys.argv[1], capacity_bytes=1 << 26) as st:
    st.register_mem_pool_host(hp)
    assert st.batch_set_v1(["p0", "p1"], torch.arange(32)) == [True, True]
PY
cd "$work"  # nothing of the repository importable from here
kv="$work/venv/bin/kvtier"
expect() {  # expect PATTERN CMD...: CMD succeeds and its output matches (read whole: no broken pipe)
  local pattern=$1 out; shift
  out=$("$@") || { echo "wheel test: '$*' failed" >&2; exit 1; }
  grep -q -- "$pattern" <<<"$out" || { echo "wheel test: '$*' printed no '$pattern':" >&2; echo "$out" >&2; exit 1; }
}
expect "inspect" "$kv" --help
expect "^kvtier [0-9]" "$kv" --version
expect "objects 4" "$kv" inspect "$work/store"
expect '"objects": 4' "$kv" stats --json "$work/store"
expect "4 objects checked, ok" "$kv" verify "$work/store"
"$work/venv/bin/python" - <<'PY'
import kvtier
try:
    kvtier.PageStore
except kvtier.KvtierError as e:
    assert "needs torch" in str(e) and "pip install" in str(e), e
else:
    raise SystemExit("kvtier.PageStore without torch should say torch is needed")
PY
echo "wheel test: ok (installed into a fresh virtualenv without torch: --help, --version, inspect, stats, verify)"
