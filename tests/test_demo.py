"""The main job (examples/kvtier_demo) runs and verifies itself; its command line reports errors in one line."""

import subprocess
import sys

import pytest

from demo_checkout import run_demo
from kvtier_demo.tour import run


def test_demo_verifies_everything(capsys):
    assert run(layers=2, pages=4, page_size=16, heads=2, conversations=2, turns=2) == 0
    out = capsys.readouterr().out
    assert "restored bit-exact: True" in out and "restored from disk bit-exact: True" in out
    assert "all checks passed" in out
    assert "MLAHostPool[page_first_direct, direct]" in out and "MLAHostPool[page_first, kernel]" in out
    assert "PageStore[demo/deepseek-like]" in out and out.count("restored from disk bit-exact: True") == 2
    assert "for all 4 requests: True" in out and "host hit" in out
    assert "no tier" in out and "worst request" in out and "p90" in out and "bench_multiturn" in out
    assert "faster to first token than no tier" in out or "slower to first token than no tier" in out


def test_cli_bad_arguments_exit_nonzero_without_traceback():
    r = run_demo("--layers", "0")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "--layers" in r.stderr  # the option as the user typed it
    r = subprocess.run([sys.executable, "-m", "kvtier", "nope"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_toy_workload_where_transformers_is_missing():
    from kvtier_demo.workload import run_workload

    out = run_workload(device="cpu", model="toy", n_conv=2, turns=2, quiet=True)
    assert out["failures"] == [] and out["model"] == "toy" and len(out["results"]) == 4


def test_the_workload_serves_a_real_architecture():
    import pytest

    pytest.importorskip("transformers")
    from kvtier_demo.workload import run_workload

    out = run_workload(device="cpu", quiet=True, restore="all")
    sources = {r["source"] for r in out["results"]}
    assert out["model"] == "llama" and out["failures"] == []
    assert {"recomputed", "host hit", "disk hit"} <= sources
    assert all(r["kv_exact"] and r["output_exact"] for r in out["results"])


def test_the_workload_with_every_layer_resident():
    import pytest

    pytest.importorskip("transformers")
    from kvtier_demo.workload import run_workload

    out = run_workload(device="cpu", quiet=True, n_conv=2, turns=2, window=0)
    assert out["window"] == out["config"].num_hidden_layers and out["failures"] == []
    assert {"host hit", "disk hit"} & {r["source"] for r in out["results"]}
    assert all(r["kv_exact"] and r["output_exact"] for r in out["results"])


def test_the_demo_restores_from_the_host_and_the_disk_bit_exact():
    """The demo's workload, planner on (its default): requests are served from the host pool and from the disk,
    every restored page and every output is the recomputed one. Whether kvtier beat no tier is the demo's own
    report (`python -m kvtier_demo`, timed against no tier in the same run), not a test: a loaded 2-core machine decides
    timings."""
    import pytest

    pytest.importorskip("transformers")
    from kvtier_demo.workload import run_workload

    out = run_workload(device="cpu", quiet=True)
    assert out["failures"] == [] and out["restore"] == "plan"
    res = out["results"]
    assert {"host hit", "disk hit"} <= {r["source"] for r in res}
    assert all(r["kv_exact"] and r["output_exact"] for r in res)


def test_the_gpu_demo_serves_a_model_the_gpu_can_hold():
    import pytest

    pytest.importorskip("transformers")
    from kvtier_demo import workload_transformers as wt

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


def test_the_chat_workload_is_shaped_like_bench_multiturn():
    """SGLang's bench_multiturn's defaults on a GPU (512 tokens of request and 64 of answer a round, 5 rounds), a
    quarter of them on the CPU; a system prompt every conversation shares; each request extends its own history;
    conversations served in a random order, each in its own order; more history than the host pool holds."""
    import pytest

    pytest.importorskip("transformers")
    from kvtier_demo import workload_transformers as wt

    assert {k: wt.SIZES["cuda"][k] for k in ("request", "output", "rounds")} == dict(request=512, output=64, rounds=5)
    assert {k: wt.SIZES["cpu"][k] for k in ("request", "output", "rounds")} == dict(request=128, output=16, rounds=5)
    for device in ("cpu", "cuda"):
        z = wt.SIZES[device]
        reqs = wt.conversations(z["conversations"], z["rounds"], z, 1000, seed=0)
        assert len(reqs) == z["conversations"] * z["rounds"]
        system = reqs[0]["tokens"][: z["system"]]
        last: dict[int, list[int]] = {}
        for r in reqs:
            c, t, tokens = r["conversation"], r["turn"], r["tokens"]
            assert len(tokens) == z["system"] + t * z["request"] + (t - 1) * z["output"]
            assert tokens[: z["system"]] == system
            assert t == 1 or tokens[: len(last[c])] == last[c]  # the history so far, then the answer and a request
            assert t == len([x for x in reqs[: reqs.index(r) + 1] if x["conversation"] == c])
            last[c] = tokens
        order = [r["conversation"] for r in reqs]
        assert order != sorted(order) and order[: z["conversations"]] != list(range(z["conversations"]))
        histories = sum(len(t) - z["system"] for t in last.values()) + z["system"]
        assert histories > 1.3 * z["host_pages"] * z["page_size"]  # the host pool cannot keep them all
        # the same seed, the same requests (two nodes of the cluster demo serve the same workload)
        assert wt.conversations(z["conversations"], z["rounds"], z, 1000, seed=0) == reqs


def test_the_report_gives_rounds_and_percentiles(capsys):
    import pytest

    pytest.importorskip("transformers")
    from kvtier_demo import workload_transformers as wt

    assert wt.ratio_quantile([0.5, 0.1, 0.9, 0.3], 0.5) == 0.3 and wt.ratio_quantile([0.5, 0.1, 0.9, 0.3], 0.9) == 0.9
    assert wt.ratio_quantile([2.0], 0.9) == 2.0 and wt.ratio_quantile(list(range(10)), 0.9) == 8
    out = wt.run(device="cpu", n_conv=3, turns=2, seed=1, store_dir=None, keep=False, quiet=False, cluster=None)
    text = capsys.readouterr().out
    assert out["failures"] == [] and {r["turn"] for r in out["results"]} == {1, 2}
    assert out["conversations"] == 3 and out["turns"] == 2 and out["window"] == out["config"].num_hidden_layers
    rounds = [line for line in text.splitlines() if line[:1] in ("1", "2") and line.split()[1:2] == ["3"]]
    assert len(rounds) == 2, text  # one row per round: 3 requests each
    assert "per request, kvtier/no tier p50" in text and "p90" in text and ("round 1" in text or "round 2" in text)


def test_a_failed_cluster_demo_keeps_the_logs_it_points_to(tmp_path, monkeypatch, capsys):
    """`python -m kvtier_demo --cluster` whose cluster fails keeps its directory of logs (it removed the log its error
    named) and says where it is; with nothing logged there is nothing to keep."""
    from pathlib import Path

    from kvtier import KvtierError
    from kvtier_demo import cluster
    from kvtier.tiers import local_cluster

    class Broken:
        def __init__(self, *, log_dir, **_):
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            (Path(log_dir) / "master.log").write_text("master: bind failed\n")
            raise KvtierError(f"the master exited; see {log_dir}/master.log")

    monkeypatch.setattr(local_cluster, "LocalCluster", Broken)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KvtierError, match="master.log"):
        cluster.run_cluster()
    (kept,) = list(tmp_path.iterdir())
    assert (kept / "logs" / "master.log").read_text() == "master: bind failed\n"
    assert f"kept {kept}" in capsys.readouterr().err
    kept.rename(tmp_path.parent / (tmp_path.name + "-kept"))

    class Absent:
        def __init__(self, **_):
            raise KvtierError("kvtier's cluster tier needs Mooncake")

    monkeypatch.setattr(local_cluster, "LocalCluster", Absent)
    with pytest.raises(KvtierError, match="needs Mooncake"):
        cluster.run_cluster()
    assert list(tmp_path.iterdir()) == []
