#!/usr/bin/env bash
# Engine environments as their users have them. For each engine (SGLang, vLLM): a virtualenv in which pip
# resolved the engine normally, with its whole dependency tree (so the torch and transformers it pins);
# kvtier's wheel, built once, installed there as `kvtier[transformers]` without changing any of the engine's
# packages (pip freeze compared before and after, pip check no worse); then the engine's conformance tests
# and the transformers integration's tests run against that environment's packages.
#
# Usage: scripts/engine_envs.sh [sglang|vllm]...   (default: both; `make engine-envs`)
# Idempotent: an environment whose engine, test packages and kvtier wheel are already installed is kept as
# it is (stamps in the venv); the wheel is rebuilt only when a source is newer than it; tests always run.
# Environment: ENGINE_ENVS_DIR (default .venvs), PYTHON (>= 3.11; default python3), MATURIN (default
# .venv/bin/maturin, else maturin on PATH), ENGINE_ENVS_TESTS=0 to set up without running the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
dir=${ENGINE_ENVS_DIR:-$repo/.venvs}
python=${PYTHON:-python3}

declare -A SPEC=([sglang]="sglang==0.5.23" [vllm]="vllm==0.33.0")
# what kvtier.integrations.<engine> imports from the engine: checked before any test runs
declare -A IMPORTS=(
  [sglang]="import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.storage.backend_factory"
  [vllm]="import vllm.v1.kv_offload.tiering.base, vllm.v1.kv_offload.tiering.factory, vllm.v1.kv_offload.tiering.spec, vllm.v1.kv_offload.config"
)
declare -A ENGINE_TESTS=(
  [sglang]="tests/test_sglang.py tests/test_sglang_v2.py tests/test_sglang_v2_faults.py"
  [vllm]="tests/test_vllm.py"
)
TRANSFORMERS_TESTS="tests/test_transformers.py tests/test_transformers_faults.py tests/test_transformers_keys.py
  tests/test_restore_planning.py tests/test_restore_edge_cases.py"
TEST_DEPS=("pytest>=8" "pytest-timeout>=2" "hypothesis>=6")

t0=$SECONDS
say() { printf 'engine-envs [%4ds] %s\n' $((SECONDS - t0)) "$*"; }
die() { printf 'engine-envs: FAILED: %s\n' "$*" >&2; exit 1; }
# run LOG DESCRIPTION CMD...: CMD's output goes to LOG; on failure its last lines and the log's path are shown
run() {
  local log=$1 what=$2; shift 2
  if ! "$@" >"$log" 2>&1; then
    tail -n 25 "$log" >&2
    die "$what (full output: $log)"
  fi
}

engines=("$@")
[ ${#engines[@]} -gt 0 ] || engines=(sglang vllm)
for e in "${engines[@]}"; do
  [ -n "${SPEC[$e]:-}" ] || die "unknown engine '$e' (expected: ${!SPEC[*]})"
done
command -v "$python" >/dev/null || die "no '$python' (set PYTHON to a Python >= 3.11)"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  die "$python is Python $("$python" -c 'import sys; print(sys.version.split()[0])'); kvtier and the engines need >= 3.11"
mkdir -p "$dir"

# ---- kvtier's wheel, built once for every environment (abi3: one wheel for every Python >= 3.11)
build_wheel() {
  local wheels=("$dir"/wheel/kvtier-*.whl) newer
  if [ -e "${wheels[0]}" ]; then
    newer=$(find rust python Cargo.toml Cargo.lock pyproject.toml README.md -newer "${wheels[0]}" \
      -not -path '*/__pycache__/*' -not -name '*.so' -print -quit)
    if [ -z "$newer" ]; then
      WHEEL=${wheels[0]}
      say "kvtier wheel: up to date ($(basename "$WHEEL"))"
      return
    fi
    say "kvtier wheel: $newer changed; rebuilding"
  fi
  local maturin=${MATURIN:-}
  if [ -z "$maturin" ]; then
    if [ -x .venv/bin/maturin ]; then maturin=.venv/bin/maturin; else maturin=$(command -v maturin || true); fi
  fi
  [ -n "$maturin" ] && [ -x "$maturin" ] || die "no maturin to build kvtier's wheel: run 'make install' or set MATURIN=/path/to/maturin"
  say "kvtier wheel: building with $maturin (cargo release build: minutes when target/ is cold)"
  rm -rf "$dir/wheel.tmp" && mkdir -p "$dir/wheel.tmp"
  run "$dir/wheel.log" "maturin build --release" "$maturin" build --release -o "$dir/wheel.tmp"
  rm -rf "$dir/wheel" && mv "$dir/wheel.tmp" "$dir/wheel"
  wheels=("$dir"/wheel/kvtier-*.whl)
  [ -e "${wheels[0]}" ] || die "maturin build left no kvtier wheel in $dir/wheel (see $dir/wheel.log)"
  WHEEL=${wheels[0]}
  say "kvtier wheel: built $(basename "$WHEEL")"
}

# what pip freeze says, less kvtier itself (its line is a local file URL)
freeze() { "$1/bin/python" -m pip freeze --all 2>/dev/null | grep -v -i '^kvtier[ =@]' | LC_ALL=C sort; }
# the engine's torch and transformers, and what the engine's metadata requires of them
pins() {
  "$1/bin/python" - "$2" <<'PY'
import sys
from importlib.metadata import requires, version
from pip._vendor.packaging.requirements import Requirement
engine = sys.argv[1]
reqs = {r.name.lower(): r for r in map(Requirement, requires(engine) or ()) if r.marker is None or r.marker.evaluate()}
bad = []
for name in ("torch", "transformers"):
    have, want = version(name), reqs[name].specifier if name in reqs else "(not required)"
    print(f"  {engine} {version(engine)}: {name} {have} (requires {name}{want})")
    if name in reqs and not reqs[name].specifier.contains(have, prereleases=True):
        bad.append(f"{name} {have} does not satisfy {engine}'s {reqs[name]}")
if bad:
    sys.exit("; ".join(bad))
PY
}

setup_env() {
  local e=$1 spec=${SPEC[$1]} venv="$dir/$1" logs="$dir/$1-logs"
  mkdir -p "$logs"
  local py="$venv/bin/python"
  if [ "$(cat "$venv/.kvtier-engine" 2>/dev/null)" != "$spec" ]; then
    # measured installed: sglang 11 GB, vllm 9.5 GB; pip also unpacks each wheel in a temporary directory
    local free_gb
    free_gb=$(df -Pk "$dir" | awk 'NR == 2 { print int($4 / 1048576) }')
    [ "$free_gb" -ge 12 ] || die "$e: its environment takes ~10-11 GB and pip needs room to unpack; only $free_gb GB free under $dir"
  fi
  if [ ! -x "$py" ]; then
    say "$e: creating $venv ($("$python" --version))"
    run "$logs/venv.log" "creating the virtualenv $venv" "$python" -m venv "$venv"
    run "$logs/pip-upgrade.log" "upgrading pip in $venv" "$py" -m pip install -q --upgrade pip
  fi
  # 1. the engine, resolved by pip with its dependencies (about 200 packages, ~4 GB of wheels on a cold cache)
  if [ "$(cat "$venv/.kvtier-engine" 2>/dev/null)" != "$spec" ]; then
    say "$e: pip install $spec with its dependencies (~200 packages, ~4 GB of wheels, ~10 GB installed: minutes)"
    local s=$SECONDS
    run "$logs/pip-engine.log" "pip install $spec" "$py" -m pip install --progress-bar off "$spec"
    run "$logs/import.log" "importing what kvtier uses from $e" "$py" -c "${IMPORTS[$e]}"
    freeze "$venv" >"$venv/freeze-engine.txt"
    echo "$spec" >"$venv/.kvtier-engine"
    rm -f "$venv/.kvtier-test-deps" "$venv/.kvtier-wheel"
    say "$e: installed $(wc -l <"$venv/freeze-engine.txt") packages in $((SECONDS - s)) s"
  else
    say "$e: $spec already installed"
  fi
  pins "$venv" "$e" || die "$e: pip resolved torch/transformers outside what $spec requires"
  # 2. what the tests need and the engine does not (pytest, pytest-timeout, hypothesis): nothing else changes
  if [ ! -e "$venv/.kvtier-test-deps" ]; then
    say "$e: pip install ${TEST_DEPS[*]} (test runners only)"
    freeze "$venv" >"$logs/freeze-before-tests.txt"
    run "$logs/pip-test-deps.log" "pip install ${TEST_DEPS[*]}" "$py" -m pip install -q "${TEST_DEPS[@]}"
    freeze "$venv" >"$logs/freeze-after-tests.txt"
    # a changed line shows up as a removal ('<'): additions alone are fine
    if diff "$logs/freeze-before-tests.txt" "$logs/freeze-after-tests.txt" | grep '^<'; then
      die "$e: installing the test packages changed the packages above (see $logs/pip-test-deps.log)"
    fi
    touch "$venv/.kvtier-test-deps"
  fi
  # 3. kvtier's wheel with its transformers extra: the engine's packages must stay exactly as they are
  local sum
  sum=$(sha256sum "$WHEEL" | cut -d' ' -f1)
  if [ "$(cat "$venv/.kvtier-wheel" 2>/dev/null)" != "$sum" ]; then
    say "$e: pip install '$(basename "$WHEEL")[transformers]'"
    freeze "$venv" >"$logs/freeze-before-kvtier.txt"
    "$py" -m pip check >"$logs/pip-check-before.txt" 2>&1 || true
    "$py" -m pip uninstall -q -y kvtier >/dev/null 2>&1 || true
    run "$logs/pip-kvtier.log" "pip install kvtier[transformers] into $venv" "$py" -m pip install "$WHEEL[transformers]"
    freeze "$venv" >"$logs/freeze-after-kvtier.txt"
    if ! diff -u "$logs/freeze-before-kvtier.txt" "$logs/freeze-after-kvtier.txt" >"$logs/freeze-kvtier.diff"; then
      cat "$logs/freeze-kvtier.diff" >&2
      die "$e: installing kvtier[transformers] changed the environment's packages (diff above; pip's output: $logs/pip-kvtier.log)"
    fi
    "$py" -m pip check >"$logs/pip-check-after.txt" 2>&1 || true
    if grep -i kvtier "$logs/pip-check-after.txt" || [ -n "$(comm -13 <(sort "$logs/pip-check-before.txt") <(sort "$logs/pip-check-after.txt"))" ]; then
      die "$e: pip check reports new problems after installing kvtier (see $logs/pip-check-after.txt)"
    fi
    echo "$sum" >"$venv/.kvtier-wheel"
    say "$e: kvtier installed; pip freeze unchanged but for kvtier; pip check: $(head -n 1 "$logs/pip-check-after.txt")"
  else
    say "$e: this kvtier wheel already installed"
  fi
}

run_tests() {
  local e=$1 venv="$dir/$1" logs="$dir/$1-logs"
  # the installed kvtier, never the checkout's python/ directory
  (cd /tmp && "$venv/bin/python" -c 'import sys, kvtier; assert kvtier.__file__.startswith(sys.prefix), kvtier.__file__') ||
    die "$e: kvtier does not import from $venv"
  # shellcheck disable=SC2086
  local tests=(${ENGINE_TESTS[$e]} $TRANSFORMERS_TESTS) s=$SECONDS rc=0
  say "$e: pytest ${tests[*]}"
  # as in the activated environment: its tools on PATH (SGLang JIT-builds its page-hash extension with ninja)
  { PATH="$venv/bin:$PATH" "$venv/bin/pytest" -p no:cacheprovider -q "${tests[@]}"; echo $? >"$logs/pytest.rc"; } 2>&1 | tee "$logs/pytest.log" |
    grep --line-buffered -E '%\]$|^(FAILED|ERROR|SKIPPED)' || true
  rc=$(cat "$logs/pytest.rc")
  say "$e: pytest exit $rc in $((SECONDS - s)) s: $(grep -E '(passed|failed|error|skipped).* in [0-9.]+s' "$logs/pytest.log" | tail -n 1)"
  return "$rc"
}

build_wheel
failed=()
for e in "${engines[@]}"; do
  setup_env "$e"
  if [ "${ENGINE_ENVS_TESTS:-1}" != 0 ]; then
    run_tests "$e" || failed+=("$e")
  fi
done
for e in "${engines[@]}"; do
  say "$e: $(du -sh "$dir/$e" | cut -f1) in $dir/$e; $("$dir/$e/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
done
[ ${#failed[@]} -eq 0 ] || die "tests failed in: ${failed[*]} (logs: $dir/<engine>-logs/pytest.log)"
say "done"
