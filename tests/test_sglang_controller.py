"""SGLang's own HiCacheController (its backup, prefetch, prefetch-IO and sync threads, its page hashes and its
zero-copy storage calls) driving kvtier as its L3, loaded by SGLang's factory from the README's extra config, on
the CPU (benches/python/sglang_controller.py: SGLang's device pool, allocator and host pool; what stands in for
the scheduler is named there). Each run is a process of its own (torch.distributed, SGLang's parallel context),
as a server is. Every restored page is compared with the bytes written; SGLang's own HiCacheFile runs the same
workload beside it. The script's --device cuda mode (the whole device -> host -> L3 -> host -> device trip) runs on
a GPU in the CUDA-marked test, and its logic on the CPU through --round-trip."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")
pytestmark = pytest.mark.timeout(600)
SCRIPT = Path(__file__).resolve().parent.parent / "benches" / "python" / "sglang_controller.py"


def run(tmp_path, *args):
    # (SGLang builds its page-hash extension with ninja, from the environment's bin directory)
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    r = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--requests", "3", "--pages", "6", *args],
                       capture_output=True, text=True, env=env, timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.mark.parametrize("layout", ["page_first_direct", "page_first"])
@pytest.mark.parametrize("model", ["mha", "asym", "mla"])
def test_sglangs_controller_writes_through_and_prefetches_every_page_exactly(tmp_path, model, layout):
    """MHA, MiMo-V2's asymmetric K 192 / V 128 and MLA, in both of SGLang's page-first layouts."""
    out, _ = run(tmp_path, "--no-planner", "--model", model, "--layout", layout)
    assert out["backend_class"] == "KvtierStorage" and out["model"] == model
    assert out["written_pages"] == out["restored_pages"] == 18
    assert out["compared_bytes"] > 0 and out["mismatched_pages"] == 0


def test_a_restarted_server_prefetches_what_the_last_one_wrote(tmp_path):
    w, _ = run(tmp_path, "--no-planner", "--model", "asym", "--phase", "write")
    r, _ = run(tmp_path, "--no-planner", "--model", "asym", "--phase", "read")
    assert w["written_pages"] == r["restored_pages"] == 18 and r["mismatched_pages"] == 0


def test_the_default_planner_declines_a_slow_disk_and_says_so(tmp_path):
    """The README's config with the planner on (the default): on a disk slower than the default engine's 5 GB/s
    of KV, SGLang is told of no stored page, and the log says why and what to set."""
    out, err = run(tmp_path)
    assert out["written_pages"] == 18 and out["restored_pages"] == 0
    assert err.count("restore planner reports 0 of") == 1 and "restore_planner: false" in err


def test_sglangs_own_file_backend_runs_the_same_workload(tmp_path):
    out, _ = run(tmp_path, "--backend", "file")
    assert out["backend_class"] == "HiCacheFile"
    assert out["written_pages"] == out["restored_pages"] == 18 and out["mismatched_pages"] == 0


@pytest.mark.parametrize("model", ["mha", "asym", "mla"])
def test_the_gpu_round_trip_runs_on_the_cpu_with_the_stand_in_direct_ops(tmp_path, model):
    """--round-trip: the --device cuda mode's whole trip (device rows -> cc.write -> write_storage -> prefetch ->
    cc.load + start_loading -> device rows), its device pool on the CPU and the stand-in's direct ops put into
    SGLang's pool modules: a check of the script's logic (SGLang's CUDA path is the test below)."""
    out, _ = run(tmp_path, "--no-planner", "--model", model, "--round-trip")
    assert out["device"] == "cpu" and out["layout"] == "page_first_direct" and "error" not in out
    assert out["written_pages"] == out["restored_pages"] == out["loaded_pages"] == 18
    assert out["backup_mismatched_pages"] == out["mismatched_pages"] == out["load_mismatched_pages"] == 0
    assert out["device_compared_bytes"] == out["compared_bytes"] > 0
    assert out["transfer_calls"]["transfer_kv_per_layer_direct_pf_lf"] > 0 and not out["jit_kernels_used"]


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["mha", "asym"])
def test_sglangs_controller_round_trips_every_page_through_the_gpu(tmp_path, model):
    """--device cuda: SGLang's device pool on the GPU and its pinned host pool; every page goes device -> host
    (cc.write) -> kvtier -> host (prefetch) -> device (cc.load, layer by layer) and comes back byte for byte,
    with sgl_kernel's direct ops (the real ones, or kvtier's stand-in where they do not import)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out, _ = run(tmp_path, "--no-planner", "--model", model, "--device", "cuda", "--io-backend", "direct")
    assert out["device"] == "cuda" and out["layout"] == "page_first_direct" and "error" not in out
    assert out["sgl_kernel"] in ("real", "stand-in") and out["backend_class"] == "KvtierStorage"
    assert out["written_pages"] == out["restored_pages"] == out["loaded_pages"] == 18
    assert out["backup_mismatched_pages"] == out["mismatched_pages"] == out["load_mismatched_pages"] == 0
    assert out["device_compared_bytes"] == out["compared_bytes"] > 0
    assert out["transfer_calls"]["transfer_kv_all_layer_direct_lf_pf"] > 0


def test_a_burst_of_requests_through_the_controller_and_a_model_on_the_cpu(tmp_path):
    """sglang_serving.py's logic on the CPU (a 4-layer model): every variant and policy serves every request, each
    request's prompt is loaded or computed and never both or neither, and waiting for the prefetch takes every
    stored page that was reported (the planner's decision, and best_effort's take, depend on this machine)."""
    out = tmp_path / "serving.json"
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    r = subprocess.run([sys.executable, str(SCRIPT.parent / "sglang_serving.py"), "--device", "cpu", "--tiny",
                        "--requests", "3", "--pages", "4", "--page-size", "16", "--new", "32",
                        "--dir", str(tmp_path / "l3"), "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {(x["variant"], x["policy"]): x for x in json.loads(out.read_text())}
    assert set(rows) == {(v, p) for v in ("planner", "all") for p in ("best_effort", "wait_complete")}
    for row in rows.values():
        assert row["requests"] == len(row["rows"]) == 3 and row["prompt_tokens"] == 4 * 16 + 32
        for req in row["rows"]:
            assert req["taken"] % 16 == 0 and req["taken"] <= req["hit"] and req["taken"] + req["computed"] == 96
    every = rows[("all", "wait_complete")]
    assert every["reported_tokens"] == every["loaded_tokens"] == 3 * 64 and every["computed_tokens"] == 3 * 32
    assert rows[("all", "best_effort")]["reported_tokens"] == 3 * 64
