"""The benches run from the source checkout (benches/python/kvtier_bench; the package holds none): where they are,
and ``python -m kvtier_bench ...`` in a child process that imports them beside this kvtier."""

import os
import subprocess
import sys
from pathlib import Path

import kvtier

BENCHES = Path(__file__).resolve().parent.parent / "benches" / "python"


def bench_env() -> dict[str, str]:
    """The environment whose PYTHONPATH finds this kvtier (whatever the working directory) and the benches."""
    paths = [os.path.dirname(os.path.dirname(os.path.abspath(kvtier.__file__))), str(BENCHES)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def run_bench(*args: str, cwd=None, timeout=None) -> subprocess.CompletedProcess:
    """``python -m kvtier_bench ARGS`` as a user runs it from a checkout."""
    return subprocess.run([sys.executable, "-m", "kvtier_bench", *args], capture_output=True, text=True, cwd=cwd,
                          env=bench_env(), timeout=timeout)


def import_benches() -> None:
    """Puts benches/python on sys.path, so that this process can ``import kvtier_bench``."""
    if str(BENCHES) not in sys.path:
        sys.path.insert(0, str(BENCHES))
