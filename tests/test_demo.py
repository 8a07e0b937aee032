"""The main job runs and verifies itself; the command line reports errors in one line."""

import subprocess
import sys

from kvtier.demo import run


def test_demo_verifies_everything(capsys):
    assert run(layers=2, pages=4, page_size=16, heads=2, conversations=2, turns=2) == 0
    out = capsys.readouterr().out
    assert "restored bit-exact: True" in out and "restored from disk bit-exact: True" in out
    assert "all checks passed" in out
    assert "MLAHostPool[page_first_direct, direct]" in out and "MLAHostPool[page_first, kernel]" in out
    assert "PageStore[demo/deepseek-like]" in out and out.count("restored from disk bit-exact: True") == 2
    assert "outputs equal for all 4 requests: True" in out and "host hit" in out
    assert "recompute instead" in out and "restore" in out  # load time apart from the suffix's compute


def test_cli_bad_arguments_exit_nonzero_without_traceback():
    r = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--layers", "0"], capture_output=True, text=True)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "--layers" in r.stderr  # the option as the user typed it
    r = subprocess.run([sys.executable, "-m", "kvtier", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_toy_workload_where_transformers_is_missing():
    from kvtier.workload import run_workload

    out = run_workload(device="cpu", model="toy", n_conv=2, turns=2, quiet=True)
    assert out["failures"] == [] and out["model"] == "toy" and len(out["results"]) == 4


def test_the_workload_serves_a_real_architecture():
    import pytest

    pytest.importorskip("transformers")
    from kvtier.workload import run_workload

    out = run_workload(device="cpu", quiet=True)
    sources = {r["source"] for r in out["results"]}
    assert out["model"] == "llama" and out["failures"] == []
    assert {"recomputed", "host hit", "disk hit"} <= sources
    assert all(r["kv_exact"] and r["output_exact"] for r in out["results"])
