#!/usr/bin/env bash
# The checksum's code paths on CPUs this machine is not: kvtier-core's hash tests (the fast checksum against
# the crc32c crate at every length to 600 from 64 offsets and 3,000 random lengths to 40 KiB) run under
# qemu-user with CPU models that take crc-fast's other paths:
#   x86_64:  qemu64 (no SSE4.2: tables), Nehalem (SSE4.2, no carry-less multiply), Westmere and Haswell
#            (SSE4.2 with PCLMULQDQ), Skylake-Server (qemu's TCG drops its AVX-512), max;
#   aarch64: max, cortex-a57, cortex-a53 (CRC and PMULL).
# The AVX-512 paths run natively (the CPU machine and the H200 machine both have AVX-512 with VPCLMULQDQ).
# Needs qemu-user (qemu-x86_64, qemu-aarch64); aarch64 also needs gcc-aarch64-linux-gnu, libc6-dev-arm64-cross
# and `rustup target add aarch64-unknown-linux-gnu`. A missing tool skips its part with the reason.
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CHECKSUM_PATHS_TARGET:-$PWD/target/checksum-paths}
rc=0
bin() { # $@: cargo args; prints the lib test binary
  cargo test -q -p kvtier-core --lib --no-run --message-format=json "$@" |
    sed -n 's/.*"executable":"\([^"]*kvtier_core-[^"]*\)".*/\1/p' | tail -1
}
run() { # $1: qemu, $2: cpu, $3: binary, rest: qemu args
  local q=$1 cpu=$2 b=$3; shift 3
  if "$q" -cpu "$cpu" "$@" "$b" hash:: 2>/dev/null | grep -q "test result: ok. 6 passed"; then
    echo "checksum paths: $q -cpu $cpu: the hash tests passed"
  else
    echo "checksum paths: $q -cpu $cpu: FAILED" >&2; rc=1
  fi
}
if command -v qemu-x86_64 > /dev/null; then
  b=$(bin) || exit 1
  for cpu in qemu64 Nehalem Westmere Haswell Skylake-Server max; do run qemu-x86_64 "$cpu" "$b"; done
else
  echo "checksum paths: x86_64 skipped (no qemu-x86_64: apt-get install qemu-user)"
fi
if command -v qemu-aarch64 > /dev/null && command -v aarch64-linux-gnu-gcc > /dev/null &&
  rustup target list --installed 2> /dev/null | grep -q aarch64-unknown-linux-gnu; then
  b=$(CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
    bin --target aarch64-unknown-linux-gnu) || exit 1
  for cpu in max cortex-a57 cortex-a53; do run qemu-aarch64 "$cpu" "$b" -L /usr/aarch64-linux-gnu; done
else
  echo "checksum paths: aarch64 skipped (needs qemu-aarch64, aarch64-linux-gnu-gcc and the rustup target)"
fi
exit $rc
