"""One new page's round trip (GPU → host → disk → host → GPU) crosses from Python into Rust once per
operation, also when its index tensors are new, and passes through a bounded set of kvtier Python functions
(benches/python/count_round_trip.py; docs/ARCHITECTURE.md writes the path down)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benches", "python", "count_round_trip.py")


def count(tmp_path, *args: str) -> dict:
    out = tmp_path / "count.jsonl"
    subprocess.run([sys.executable, SCRIPT, *args, "--out", str(out)], check=True, timeout=300,
                   capture_output=True)
    result: dict = json.loads(out.read_text().splitlines()[-1])
    return result


def test_cpu_round_trip_is_one_native_call_per_operation(tmp_path):
    r = count(tmp_path, "cpu")
    calls, layers = r["native_calls"], r["layers"]
    assert calls["backup"] == ["plan_sides"]  # new indices: validated, planned and copied in one call
    assert calls["store write"] == ["PageStore.put_pages"]
    assert calls["store read"] == ["PageStore.get_pages"]
    assert calls["load"] == ["plan_sides"] + ["copy_cpu"] * (layers - 1)  # one per layer
    # (each store batch also feeds its tier's meter, and converts its indices and calls through kvtier.native_calls)
    assert r["python_functions"] <= 21, r["functions"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stream", ["side", "default"])
def test_cuda_round_trip_is_one_native_call_per_operation(tmp_path, stream):
    r = count(tmp_path, "cuda", *(["--default-stream"] if stream == "default" else []))
    calls, layers = r["native_calls"], r["layers"]
    assert calls["backup"] == ["plan_sides"]
    assert calls["store write"] == ["PageStore.put_pages"]
    assert calls["store read"] == ["PageStore.get_pages"]
    assert r["route"] == "dma"  # the copy engine (the kernel route validates, then launches)
    if stream == "side":
        assert calls["load"] == ["plan_sides"] + ["submit_layers"] * (layers - 1)
    else:  # the first warm load forks to the detour from Python; the next ones fork, copy and join in one call
        assert calls["load"] == ["plan_sides", "submit_layers"] + ["submit_layers_detour"] * (layers - 2)
    assert r["python_functions"] <= 28, r["functions"]  # (as on the CPU: the meter, kvtier.native_calls)
