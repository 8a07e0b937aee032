"""The demo runs from the source checkout (examples/kvtier_demo; the package holds none of it): where it is, and
``python -m kvtier_demo ...`` in a child process that imports it beside this kvtier. (In this process pytest puts
examples/ on sys.path: pyproject's ``pythonpath``.)"""

import os
import subprocess
import sys
from pathlib import Path

import kvtier

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def demo_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with a PYTHONPATH that finds this kvtier (whatever the working directory)
    and the demo."""
    env = dict(os.environ if env is None else env)
    paths = [os.path.dirname(os.path.dirname(os.path.abspath(kvtier.__file__))), str(EXAMPLES)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    return dict(env, PYTHONPATH=os.pathsep.join(paths))


def demo_cmd(*args: str) -> list[str]:
    """``python -m kvtier_demo ARGS`` as a user runs it from a checkout (with :func:`demo_env`)."""
    return [sys.executable, "-m", "kvtier_demo", *args]


def run_demo(*args: str, cwd=None, timeout=None) -> subprocess.CompletedProcess:
    """``python -m kvtier_demo ARGS``, run to its end."""
    return subprocess.run(demo_cmd(*args), capture_output=True, text=True, cwd=cwd, env=demo_env(), timeout=timeout)
