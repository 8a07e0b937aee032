"""Fault injection end to end: IO errors, short and torn writes, ENOSPC and a slow disk injected into the page
store under the tier controller while the demo workload (a real model, multi-turn requests with shared
prefixes) is served. Every request must still produce exactly the output of a fresh recomputation (a failed
or corrupt page is a miss, recomputed), and the stats must say what failed."""

import errno

import pytest

import kvtier
from kvtier import testing
from kvtier_demo.workload import run_workload


@pytest.fixture(autouse=True)
def _no_faults_left():
    testing.clear_faults()
    yield
    testing.clear_faults()


def serve():
    out = run_workload(device="cpu", quiet=True, restore="all")  # every stored page is read: the faults are met
    sources = [r["source"] for r in out["results"]]
    return out, sources


def test_baseline_serves_from_disk():
    out, sources = serve()
    assert out["failures"] == []
    assert "disk hit" in sources  # the fault runs below matter only if the store is really used
    assert out["store"]["write_failures"] == out["store"]["read_failures"] == out["store"]["corrupt_reads"] == 0


# (point, kind, extra arguments, the store counter that must show it, the controller counter that must show it)
CASES = [
    ("data_write", "error", dict(errno=errno.EIO), "write_failures", "store_write_failures"),
    ("data_write", "short", dict(errno=errno.EIO), "write_failures", "store_write_failures"),
    ("fallocate", "error", dict(errno=errno.ENOSPC), "write_failures", "store_write_failures"),
    ("data_sync", "error", dict(errno=errno.EIO), "write_failures", "store_write_failures"),
    ("journal_sync", "error", dict(errno=errno.ENOSPC), "write_failures", "store_write_failures"),
    ("data_read", "error", dict(errno=errno.EIO), "read_failures", "prefetch_misses"),
    ("data_write", "torn", {}, "corrupt_reads", "prefetch_misses"),
]


@pytest.mark.parametrize("point,kind,kw,store_counter,ctrl_counter", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_request_correct_under_persistent_faults(point, kind, kw, store_counter, ctrl_counter):
    testing.inject_fault(point, kind, times=None, **kw)
    out, sources = serve()
    assert testing.fault_hits(point) > 0, "the fault was never reached"
    assert out["failures"] == [], f"wrong KV or output under {point}/{kind}: {out['failures']}"
    assert out["store"][store_counter] > 0, out["store"]
    assert getattr(out["stats"], ctrl_counter) > 0, out["stats"]
    if store_counter == "write_failures":
        assert out["stats"].store_writes == 0 and "disk hit" not in sources  # nothing reached the disk
    else:
        assert "disk hit" not in sources  # every read was refused or failed its checksum: recomputed


def test_intermittent_faults_keep_the_good_pages():
    # a burst of short writes and a burst of failed reads in the middle of the run: the pages written
    # before and after are still served from disk
    testing.inject_fault("data_write", "short", errno=errno.EIO, skip=10, times=6)
    testing.inject_fault("data_read", "error", errno=errno.EIO, skip=4, times=3)
    out, sources = serve()
    assert out["failures"] == []
    assert testing.fault_hits("data_write") == 6 and testing.fault_hits("data_read") == 3
    assert out["store"]["write_failures"] == 6 and out["store"]["read_failures"] == 3
    assert "disk hit" in sources


def test_slow_disk_is_slower_not_wrong():
    testing.inject_fault("data_read", "delay", delay_ms=20, times=None)
    testing.inject_fault("data_write", "delay", delay_ms=5, times=None)
    out, sources = serve()
    assert out["failures"] == [] and "disk hit" in sources
    assert testing.fault_hits("data_read") > 0
    assert out["store"]["write_failures"] == out["store"]["read_failures"] == 0


def test_bad_fault_arguments_are_named():
    with pytest.raises(kvtier.InvalidArgumentError, match="point"):
        testing.inject_fault("nowhere")
    with pytest.raises(kvtier.InvalidArgumentError, match="kind"):
        testing.inject_fault("data_read", "torn")
    with pytest.raises(kvtier.InvalidArgumentError, match="kind"):
        testing.inject_fault("data_read", "explode")
    with pytest.raises(kvtier.InvalidArgumentError, match="times"):
        testing.inject_fault("data_read", times=-1)
    with pytest.raises(kvtier.InvalidArgumentError, match="errno"):
        testing.inject_fault("data_read", errno=0)
    with testing.faults("data_read", "error", times=None):
        pass
    assert testing.fault_hits("data_read") == 0  # cleared on exit
