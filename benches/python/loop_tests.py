"""Runs pytest on the same tests ROUNDS times in one process (a failure that shows once in many runs), with
every thread's stack dumped and the process ended when one round takes longer than --hang-s.

    python benches/python/loop_tests.py --rounds 6 --hang-s 150 -- tests/test_restore_tail.py -k stalled

Prints one line per round (its exit status and seconds) and a last JSON line with the counts."""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hang-s", type=float, default=150.0, help="a round longer than this dumps every stack and exits")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    a = ap.parse_args(argv)
    args = [x for x in a.pytest_args if x != "--"]
    if a.rounds < 1 or a.hang_s <= 0 or not args:
        ap.error("--rounds >= 1, --hang-s > 0 and pytest arguments after -- are required")
    import pytest

    codes, seconds = [], []
    for i in range(a.rounds):
        faulthandler.dump_traceback_later(a.hang_s, exit=True)
        t0 = time.perf_counter()
        rc = int(pytest.main(["-q", "-p", "no:cacheprovider", *args]))
        faulthandler.cancel_dump_traceback_later()
        codes.append(rc)
        seconds.append(round(time.perf_counter() - t0, 1))
        print(f"== round {i + 1}: exit {rc} after {seconds[-1]} s", flush=True)
    print(json.dumps({"rounds": a.rounds, "passed_rounds": codes.count(0), "exit_codes": codes, "seconds": seconds}))
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
