#!/usr/bin/env bash
# How a user installs kvtier, and the installed experience without torch:
# 1. the README's install commands (its `install-commands` block) as written, from the repository root, each
#    into a fresh virtualenv: `pip install .` (a build from the checkout) and `pip wheel` + `pip install` of the
#    wheel; then the source distribution (`maturin sdist`) installed into a third one (a build from what the
#    sdist holds: nothing the checkout has and the sdist lacks);
# 2. in the wheel's virtualenv (no torch, nothing from the repository on the path) what a storage host runs:
#    `kvtier --help`, `--version`, `inspect`, `stats` and `verify` on a store, `import kvtier` with a clear
#    error where torch is needed, and `kvtier demo` saying where the demo runs (the wheel holds no demo).
# Builds reuse target/ (CARGO_TARGET_DIR), so only kvtier's own crates compile. Usage: scripts/test_wheel.sh
# [PYTHON]  (run by `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py=${1:-.venv/bin/python}
work=$(mktemp -d /tmp/kvtier-wheel-test.XXXX)
had_dist=$([ -e dist ] && echo 1 || echo 0)
cleanup() { rm -rf "$work"; [ "$had_dist" = 1 ] || rm -rf "$repo/dist"; }
trap cleanup EXIT
export CARGO_TARGET_DIR="$repo/target"
t0=$SECONDS
# the README's block, minus the `cd` into the checkout (we are in it)
mapfile -t lines < <(awk '/<!-- install-commands/{f=1; next} f && /^```bash/{g=1; next} g && /^```/{exit} g' README.md \
  | sed 's/[[:space:]]*#.*$//' | grep -v '^cd ' | grep -v '^$')
[ "${#lines[@]}" -ge 3 ] || { echo "wheel test: README's install-commands block not found" >&2; exit 1; }
python3 -m venv "$work/src-venv"
python3 -m venv "$work/venv"
for line in "${lines[@]}"; do
  case "$line" in
    "pip install .") venv=src-venv ;;
    *) venv=venv ;;
  esac
  echo "wheel test: [$venv] $line"
  (PATH="$work/$venv/bin:$PATH" VIRTUAL_ENV="$work/$venv" bash -c "$line -q" 2>&1 | grep -v "^📦\|^🐍\|^🔗\|^📡" || true)
done
"$work/src-venv/bin/kvtier" --version >/dev/null || { echo "wheel test: 'pip install .' gave no working kvtier" >&2; exit 1; }
"$work/venv/bin/python" -c "import kvtier._native" || { echo "wheel test: the README's wheel did not install" >&2; exit 1; }
# the source distribution
"$py" -m maturin sdist -o "$work/sdist" >/dev/null 2>&1
python3 -m venv "$work/sdist-venv"
"$work/sdist-venv/bin/pip" install -q "$work"/sdist/kvtier-*.tar.gz
"$work/sdist-venv/bin/kvtier" --version >/dev/null || { echo "wheel test: the sdist gave no working kvtier" >&2; exit 1; }
echo "wheel test: README install commands and the sdist installed ($((SECONDS - t0)) s)"
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
# the demo runs from a checkout (examples/kvtier_demo): none of it in the wheel, and `kvtier demo` says where (exit 2)
"$work/venv/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('kvtier.demo') is not None)" \
  || { echo "wheel test: the wheel holds kvtier.demo" >&2; exit 1; }
rc=0; out=$("$kv" demo 2>&1) || rc=$?
[ "$rc" = 2 ] && grep -q "make demo" <<<"$out" \
  || { echo "wheel test: 'kvtier demo' exited $rc without saying where the demo runs:" >&2; echo "$out" >&2; exit 1; }
echo "wheel test: ok (installed into a fresh virtualenv without torch: --help, --version, inspect, stats, verify, demo)"
