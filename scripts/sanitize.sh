#!/usr/bin/env bash
# Sanitizer runs over kvtier-core's tests (`make sanitize`, `make sanitize-quick`).
#
#   scripts/sanitize.sh [asan|asan-quick] [tsan] [miri] [valgrind]      (no argument: asan tsan miri valgrind)
#
#   asan      AddressSanitizer + LeakSanitizer, kvtier-core's unit and integration tests (nightly)
#   asan-quick  the same, unit tests only (`make sanitize-quick`, the short CI variant)  (nightly)
#   tsan      ThreadSanitizer with an instrumented std (-Zbuild-std), kvtier-core's unit and integration
#             tests, after a canary (scripts/tsan-canary); any report fails  (nightly + rust-src)
#   miri      `cargo +nightly miri`, skipped when the miri component is not installed
#   valgrind  memcheck on the plain (stable) test binary, tests of buffer, alloc, plan, journal
#             (the memory/layout modules; the Miri substitute); scripts/valgrind.supp (valgrind)
#
# Each tool builds into its own target dir (target/san-<tool>), so the normal cache is untouched.
# A missing toolchain or tool is skipped with a "skipped: ... because ..." line and does not fail the run.
# Exit status: 0 when every tool that ran passed its tests with no finding, 1 otherwise.
# Logs: target/sanitize-logs/<tool>.log.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
TRIPLE=x86_64-unknown-linux-gnu
LOGS=$ROOT/target/sanitize-logs
mkdir -p "$LOGS"
# Flags from the caller's environment would change what is built (and could drop the sanitizer flag).
unset RUSTFLAGS RUSTDOCFLAGS CARGO_ENCODED_RUSTFLAGS CARGO_BUILD_RUSTFLAGS CARGO_TARGET_DIR CARGO_BUILD_TARGET

TOOLS=("$@")
[ ${#TOOLS[@]} -eq 0 ] && TOOLS=(asan tsan miri valgrind)
FAILED=0
SUMMARY=()

say() { printf '[sanitize] %s\n' "$*"; }
skip() { # tool, reason
    local line
    line=$(printf '%-9s skipped: %s' "$1" "$2")
    say "$line"
    SUMMARY+=("$line")
}
# tool, tests run, passed, findings, seconds, ok(0/1), extra
report() {
    local line
    line=$(printf '%-9s tests run: %-3s passed: %-3s findings: %-3s duration: %4ss  %s  (log: %s)' \
        "$1" "$2" "$3" "$4" "$5" "$([ "$6" = 0 ] && echo OK || echo FAIL)" "${LOGS#"$ROOT"/}/$1.log")
    [ -n "${7:-}" ] && line="$line  [$7]"
    say "$line"
    SUMMARY+=("$line")
    [ "$6" = 0 ] || FAILED=1
}
# Sums libtest's "test result:" lines of a log: prints "run passed".
count_tests() {
    awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i) ~ /^passed;?$/) p += $(i-1); if ($(i) ~ /^failed;?$/) f += $(i-1) } }
         END { printf "%d %d\n", p + f, p }' "$1"
}

# Nightly with the sanitizer runtimes, or a reason why not.
nightly_reason() {
    if ! command -v rustup >/dev/null 2>&1; then echo "rustup is not installed (needed for +nightly)"; return; fi
    if ! rustc +nightly --version >/dev/null 2>&1; then
        echo "the nightly toolchain is not installed (rustup toolchain install nightly)"; return
    fi
    local lib
    lib="$(rustc +nightly --print sysroot)/lib/rustlib/$TRIPLE/lib"
    if ! compgen -G "$lib/librustc-*_rt.$1.a" >/dev/null; then
        echo "nightly has no $1 runtime in $lib"; return
    fi
}

run_asan() { # asan | asan-quick
    local name=$1 scope=(--lib --tests) what="unit and integration tests"
    [ "$name" = asan-quick ] && scope=(--lib) && what="unit tests"
    local why; why=$(nightly_reason asan)
    if [ -n "$why" ]; then skip "$name" "AddressSanitizer because $why"; return; fi
    local log=$LOGS/$name.log t0=$SECONDS rc
    say "$name: building and running kvtier-core's $what under AddressSanitizer + LeakSanitizer"
    # --target: build scripts and proc-macros stay uninstrumented. detect_leaks is LeakSanitizer.
    # The disk fuzzer (tests/fuzz_disk.rs) draws a random seed per run: fix it (caller may override) so a
    # failure here is reproducible with plain `cargo test`.
    KVTIER_FUZZ_SEED=${KVTIER_FUZZ_SEED:-1} \
        RUSTFLAGS="-Zsanitizer=address" RUSTDOCFLAGS="-Zsanitizer=address" \
        ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1" \
        CARGO_TARGET_DIR=target/san-asan \
        cargo +nightly test -p kvtier-core --target $TRIPLE "${scope[@]}" >"$log" 2>&1
    rc=$?
    local n; n=$(grep -cE '^(==[0-9]+==)?ERROR: (AddressSanitizer|LeakSanitizer)' "$log")
    read -r run passed < <(count_tests "$log")
    [ "$rc" = 0 ] && [ "$n" = 0 ] && [ "$run" -gt 0 ] && ok=0 || ok=1
    [ "$ok" = 0 ] || tail -n 60 "$log" | sed 's/^/    /'
    report "$name" "$run" "$passed" "$n" $((SECONDS - t0)) $ok "exit $rc"
}

# Why the TSan step cannot run here, or nothing. -Zbuild-std builds std from the rust-src component.
tsan_reason() {
    local why; why=$(nightly_reason tsan)
    if [ -n "$why" ]; then echo "$why"; return; fi
    local src; src="$(rustc +nightly --print sysroot)/lib/rustlib/src/rust/library"
    if [ ! -f "$src/Cargo.lock" ]; then
        echo "nightly has no rust-src ($src), which -Zbuild-std needs to build an instrumented std (rustup +nightly component add rust-src)"
    fi
}

# ThreadSanitizer with an instrumented std: every kvtier-core test (unit and integration), after a canary
# that proves the build reports a real race and stays silent on std-ordered hand-offs. Any report fails.
run_tsan() {
    local why; why=$(tsan_reason)
    if [ -n "$why" ]; then skip tsan "ThreadSanitizer because $why"; return; fi
    local log=$LOGS/tsan.log clog=$LOGS/tsan-canary.log t0=$SECONDS rc
    # - -Zbuild-std: std, alloc and libtest are compiled here with -Zsanitizer=thread, so TSan sees their
    #   atomics (Mutex/Condvar futex state, thread::scope's and join's completion, channels) and Arc's last
    #   drop uses an acquire load instead of a fence, which TSan does not model. rustc refuses to link a
    #   TSan crate against a std not built with the sanitizer, so no -Cunsafe-allow-abi-mismatch is passed:
    #   a successful build is itself the proof that std is instrumented.
    # - --target: build scripts and proc-macros stay uninstrumented (required by -Zbuild-std too).
    # - opt-level 1 (std included): a run at opt-level 0 takes longer; TSan instruments either way.
    # - the disk fuzzer (tests/fuzz_disk.rs) draws a random seed per run: fix it (caller may override).
    local env=(RUSTFLAGS="-Zsanitizer=thread" CARGO_PROFILE_DEV_OPT_LEVEL=1 CARGO_TARGET_DIR="$ROOT/target/san-tsan"
        TSAN_OPTIONS="suppressions=$ROOT/scripts/tsan.supp:print_suppressions=1:halt_on_error=0:second_deadlock_stack=1")
    say "tsan: canary (scripts/tsan-canary): building an instrumented std (minutes on a cold target dir)"
    local canary=$ROOT/target/san-tsan/$TRIPLE/debug/tsan-canary race=0 ordered=0
    env "${env[@]}" cargo +nightly build -Zbuild-std --manifest-path scripts/tsan-canary/Cargo.toml --target $TRIPLE \
        >"$clog" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then
        { echo "== tsan-canary race"; env "${env[@]}" "$canary" race; echo "== tsan-canary ordered"; env "${env[@]}" "$canary" ordered; } \
            >>"$clog" 2>&1
        # the race counts when TSan reports it with the canary's racing function on top of an access stack
        race=$(awk '/^== tsan-canary race/ {p = 1} /^== tsan-canary ordered/ {p = 0} p && /^ +#0 tsan_canary::bump / {n++} END {print n + 0}' "$clog")
        ordered=$(awk '/^== tsan-canary ordered/ {p = 1} p && /^WARNING: ThreadSanitizer/ {n++} END {print n + 0}' "$clog")
        grep -q '^ordered: ok' "$clog" || rc=1
    fi
    if [ "$rc" != 0 ] || [ "$race" = 0 ] || [ "$ordered" != 0 ]; then
        tail -n 40 "$clog" | sed 's/^/    /'
        report tsan 0 0 "$ordered" $((SECONDS - t0)) 1 \
            "canary: exit $rc, the race's accesses reported $race time(s) (must be >= 1), std-ordered hand-offs reported $ordered time(s) (must be 0); log ${clog#"$ROOT"/}"
        return
    fi
    say "tsan: canary ok (the race is reported, std-ordered hand-offs are not); kvtier-core's unit and integration tests"
    KVTIER_FUZZ_SEED=${KVTIER_FUZZ_SEED:-1} env "${env[@]}" \
        cargo +nightly test -Zbuild-std -p kvtier-core --target $TRIPLE --lib --tests --no-fail-fast >"$log" 2>&1
    rc=$?
    local n supp
    n=$(grep -c '^WARNING: ThreadSanitizer' "$log")
    supp=$(awk '/ThreadSanitizer: Matched [0-9]+ suppressions/ {s += $3} END {print s + 0}' "$log")
    read -r run passed < <(count_tests "$log")
    [ "$rc" = 0 ] && [ "$n" = 0 ] && [ "$run" -gt 0 ] && ok=0 || ok=1
    [ "$ok" = 0 ] || { grep -A 30 '^WARNING: ThreadSanitizer' "$log" | head -n 120 | sed 's/^/    /'; tail -n 20 "$log" | sed 's/^/    /'; }
    report tsan "$run" "$passed" "$n" $((SECONDS - t0)) $ok \
        "exit $rc; instrumented std; canary ok; $supp suppressed (scripts/tsan.supp)"
}

run_miri() {
    if ! command -v rustup >/dev/null 2>&1 || ! rustc +nightly --version >/dev/null 2>&1; then
        skip miri "Miri because the nightly toolchain is not installed"; return
    fi
    if ! cargo +nightly miri --version >/dev/null 2>&1; then
        skip miri "Miri because 'cargo +nightly miri' is unavailable (component miri not installed: rustup +nightly component add miri rust-src); valgrind covers buffer/alloc/plan/journal instead"
        return
    fi
    local log=$LOGS/miri.log t0=$SECONDS rc
    say "miri: alloc and plan tests (buffer's tests mmap/madvise, which Miri does not model)"
    CARGO_TARGET_DIR=target/san-miri MIRIFLAGS="-Zmiri-strict-provenance" \
        cargo +nightly miri test -p kvtier-core --lib -- alloc:: plan:: buffer::tests::chunks_respect_granularity >"$log" 2>&1
    rc=$?
    local n; n=$(grep -c '^error: Undefined Behavior' "$log")
    read -r run passed < <(count_tests "$log")
    [ "$rc" = 0 ] && [ "$run" -gt 0 ] && ok=0 || ok=1
    report miri "$run" "$passed" "$n" $((SECONDS - t0)) $ok "exit $rc"
}

run_valgrind() {
    if ! command -v valgrind >/dev/null 2>&1; then skip valgrind "valgrind memcheck because valgrind is not installed"; return; fi
    local log=$LOGS/valgrind.log t0=$SECONDS rc bin
    say "valgrind: memcheck over the buffer, alloc, plan and journal tests (plain stable build)"
    bin=$(CARGO_TARGET_DIR=target/san-valgrind cargo test -p kvtier-core --lib --no-run --message-format=json 2>"$log" |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])' | tail -n 1)
    if [ -z "$bin" ]; then
        cat "$log" | tail -n 30 | sed 's/^/    /'
        report valgrind 0 0 0 $((SECONDS - t0)) 1 "could not build the test binary"; return
    fi
    # Filter (SANITIZE_VALGRIND_FILTER overrides; "" runs every unit test, ~40 s): the memory/layout modules
    # and the journal parser. They use anonymous mmap (+ MAP_HUGETLB / madvise(MADV_HUGEPAGE) attempts, which
    # behave as natively: no hugetlb pages here -> ENOMEM -> fallback); no O_DIRECT, no mlock (store, roofline,
    # cuda; the store tests, O_DIRECT included, also pass under memcheck). Valgrind serializes threads.
    valgrind --error-exitcode=1 --leak-check=full --show-leak-kinds=definite,indirect,possible \
        --errors-for-leak-kinds=definite,indirect,possible --track-origins=yes --fair-sched=yes \
        --suppressions="$ROOT/scripts/valgrind.supp" -s \
        "$bin" --test-threads=2 ${SANITIZE_VALGRIND_FILTER:-buffer:: alloc:: plan:: journal::} >>"$log" 2>&1
    rc=$?
    local errs
    errs=$(grep -oE 'ERROR SUMMARY: [0-9]+ errors' "$log" | tail -n 1 | awk '{print $3}')
    local supp; supp=$(grep -oE 'used_suppression: +[0-9]+ ' "$log" | awk '{n += $2} END {print n + 0}')
    read -r run passed < <(count_tests "$log")
    [ "$rc" = 0 ] && [ "${errs:-1}" = 0 ] && [ "$run" -gt 0 ] && ok=0 || ok=1
    [ "$ok" = 0 ] || tail -n 60 "$log" | sed 's/^/    /'
    report valgrind "$run" "$passed" "${errs:-?}" $((SECONDS - t0)) $ok "exit $rc; $supp suppressed (scripts/valgrind.supp)"
}

for t in "${TOOLS[@]}"; do
    case $t in
    asan | asan-quick) run_asan "$t" ;;
    tsan) run_tsan ;;
    miri) run_miri ;;
    valgrind) run_valgrind ;;
    *) echo "unknown tool '$t' (asan, asan-quick, tsan, miri, valgrind)" >&2; exit 2 ;;
    esac
done
echo
say "summary:"
for l in "${SUMMARY[@]}"; do say "  $l"; done
exit $FAILED
