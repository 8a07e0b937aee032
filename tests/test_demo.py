"""The main job runs and verifies itself; the command line reports errors in one line."""

import subprocess
import sys

from kvtier.demo.tour import run


def test_demo_verifies_everything(capsys):
    assert run(layers=2, pages=4, page_size=16, heads=2, conversations=2, turns=2) == 0
    out = capsys.readouterr().out
    assert "restored bit-exact: True" in out and "restored from disk bit-exact: True" in out
    assert "all checks passed" in out
    assert "MLAHostPool[page_first_direct, direct]" in out and "MLAHostPool[page_first, kernel]" in out
    assert "PageStore[demo/deepseek-like]" in out and out.count("restored from disk bit-exact: True") == 2
    assert "for all 4 requests: True" in out and "host hit" in out
    assert "no tier" in out and "worst request" in out
    assert "faster to first token than no tier" in out or "slower to first token than no tier" in out


def test_cli_bad_arguments_exit_nonzero_without_traceback():
    r = subprocess.run([sys.executable, "-m", "kvtier", "demo", "--layers", "0"], capture_output=True, text=True)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "--layers" in r.stderr  # the option as the user typed it
    r = subprocess.run([sys.executable, "-m", "kvtier", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_toy_workload_where_transformers_is_missing():
    from kvtier.demo.workload import run_workload

    out = run_workload(device="cpu", model="toy", n_conv=2, turns=2, quiet=True)
    assert out["failures"] == [] and out["model"] == "toy" and len(out["results"]) == 4


def test_the_workload_serves_a_real_architecture():
    import pytest

    pytest.importorskip("transformers")
    from kvtier.demo.workload import run_workload

    out = run_workload(device="cpu", quiet=True, restore="all")
    sources = {r["source"] for r in out["results"]}
    assert out["model"] == "llama" and out["failures"] == []
    assert {"recomputed", "host hit", "disk hit"} <= sources
    assert all(r["kv_exact"] and r["output_exact"] for r in out["results"])


def test_the_workload_with_every_layer_resident():
    import pytest

    pytest.importorskip("transformers")
    from kvtier.demo.workload import run_workload

    out = run_workload(device="cpu", quiet=True, n_conv=2, turns=2, window=0)
    assert out["window"] == out["config"].num_hidden_layers and out["failures"] == []
    assert {"host hit", "disk hit"} & {r["source"] for r in out["results"]}
    assert all(r["kv_exact"] and r["output_exact"] for r in out["results"])


def _over(out):
    """Requests whose TTFT with kvtier is above the bound: 5% over no tier's (the mean of its two runs, one
    just before and one just after kvtier's), plus twice the spread of those two runs (the machine's noise at
    that moment) and 2 ms (the clock and the scheduler on a shared 2-core machine)."""
    return [(r["request"], r["source"], r["ttft_s"], r["no_tier_s"], r["no_tier_spread_s"]) for r in out["results"]
            if r["ttft_s"] > 1.05 * r["no_tier_s"] + 2 * r["no_tier_spread_s"] + 0.002]


def test_the_demo_is_never_slower_than_no_tier():
    """The demo's own measurements, planner on (its default): no request is slower with kvtier than with no
    tier (within the bound of _over), and kvtier does help (paired: a tier that never restored anything
    would pass the first check). A shared machine can stall one request of a run: a second run is allowed."""
    import pytest

    pytest.importorskip("transformers")
    from kvtier.demo.workload import run_workload

    for _ in range(2):
        out = run_workload(device="cpu", quiet=True)
        assert out["failures"] == [] and out["restore"] == "plan"
        over = _over(out)
        if not over:
            break
    assert not over, f"requests slower with kvtier than with no tier (twice): {over}"
    res = out["results"]
    assert {"host hit", "disk hit"} <= {r["source"] for r in res}
    assert sum(r["no_tier_s"] for r in res) > 1.5 * sum(r["ttft_s"] for r in res)


def test_the_gpu_demo_serves_a_model_the_gpu_can_hold():
    import pytest

    pytest.importorskip("transformers")
    from kvtier.demo import workload_transformers as wt

    assert wt.size_key("cpu") == "cpu"
    assert wt.size_key("cuda", 141 << 30) == "cuda"  # an H200: Llama-3.1-8B's shape
    assert wt.size_key("cuda", 24 << 30) == "cuda-small"  # a 24 GB card: the 1.2B model
    assert wt.size_key("cuda", 32 << 30) == "cuda-small"
    assert wt.size_key("cuda", int(39.4 * (1 << 30))) == "cuda"  # an A100 "40 GB"
    assert wt.SIZES["cuda"]["config"]["num_hidden_layers"] == 32
    assert wt.SIZES["cuda-small"]["config"]["hidden_size"] == 2048
    for key in ("cuda", "cuda-small"):  # the same workload either way
        assert {k: v for k, v in wt.SIZES[key].items() if k != "config"} == \
            {k: v for k, v in wt.SIZES["cuda"].items() if k != "config"}
