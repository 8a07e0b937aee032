"""Arguments refused before anything happens, by name: sizes with units wherever a size is taken, an empty
store path, sizes past 64 bits, a missing pool, an unknown IO backend (each once a generic error or a silent
acceptance)."""

import os

import pytest

torch = pytest.importorskip("torch")

import kvtier  # noqa: E402
from kvtier.config import parse_size  # noqa: E402


@pytest.mark.parametrize("text,want", [("64G", 64 << 30), ("512GiB", 512 << 30), ("1.5T", 3 << 39), ("4096", 4096),
                                       (" 2 gb ", 2 << 30), ("10MiB", 10 << 20), ("0.5K", 512), (7, 7)])
def test_sizes_with_units(text, want):
    assert parse_size("x", text) == want


@pytest.mark.parametrize("bad", ["abc", "G", "1.5", "inf", "nan", "-5", 1 << 80, True, 3.5, None, "64X"])
def test_bad_sizes_name_the_argument(bad):
    with pytest.raises(kvtier.InvalidArgumentError, match="`capacity_bytes`"):
        parse_size("capacity_bytes", bad)


def test_page_store_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for kw, name in ((dict(path=""), "path"), (dict(path=str(tmp_path), capacity_bytes=1 << 80), "capacity_bytes"),
                     (dict(path=str(tmp_path), capacity_bytes="lots"), "capacity_bytes"),
                     (dict(path=str(tmp_path), capacity_bytes=100), "capacity_bytes")):
        with pytest.raises(kvtier.InvalidArgumentError, match=f"`{name}`"):
            kvtier.PageStore(**kw)
    assert os.listdir(tmp_path) == []  # nothing created by a refused store
    store = kvtier.PageStore(str(tmp_path / "s"), capacity_bytes="1G")
    assert store.capacity_bytes == 1 << 30
    store.close()


def test_buffer_controller_and_loader_arguments():
    with pytest.raises(kvtier.InvalidArgumentError, match="`nbytes`"):
        kvtier.HostBuffer(1 << 70)
    with pytest.raises(kvtier.InvalidArgumentError, match="device_pool"):
        kvtier.TierController(None, None, None)
    dev = kvtier.DeviceKVPool(64, 16, 2, 1, 8, 8, torch.float32, "cpu")
    host = kvtier.host_pool_for(dev, layout="page_first_direct")
    with pytest.raises(kvtier.InvalidArgumentError, match="`io_backend`"):
        kvtier.LayerLoader(host, dev, "bogus")
    with pytest.raises(kvtier.InvalidArgumentError, match="`prefill`"):
        kvtier.TierController(dev, host, prefill="fast")
    host.close()


def test_page_hashes_need_no_torch():
    """A storage host without torch computes SGLang's page keys (it needed torch through kvtier.store)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; import kvtier; "
            "k = kvtier.page_hashes([1, 2, 3, 4, 5], 2); print(len(k), len(k[0]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["3", "64"], r.stderr[-2000:]
    assert kvtier.page_hashes(torch.arange(5), 2) == kvtier.page_hashes([0, 1, 2, 3, 4], 2)


def test_a_probe_file_left_by_a_killed_process_is_removed(tmp_path):
    """The disk probe at open writes a file beside the namespaces and removes it; a process killed during the
    probe leaves it behind. The next probe in that directory removes it (its process is gone); a live
    process's probe file is left alone, and nothing else in the directory is touched."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".kvtier-roofline-{int(dead.stdout)}-0"
    live = tmp_path / f".kvtier-roofline-{os.getpid()}-999"
    other = tmp_path / "notes.txt"
    for f in (stale, live, other):
        f.write_bytes(b"x" * 4096)
    dev = kvtier.DeviceKVPool(64, 16, 2, 1, 8, 8, torch.float32, "cpu")
    host = kvtier.host_pool_for(dev, layout="page_first_direct")
    store = kvtier.PageStore(tmp_path, capacity_bytes="64M")
    store.register_mem_pool_host(host)
    assert not stale.exists() and live.exists() and other.exists()
    assert store.measured()["disk"].source == "probe"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".kvtier-roofline")) == [live.name]
    store.close()
    host.close()


def test_taint_finds_every_key_it_was_given_however_many():
    from kvtier.tiers.objects.records import Taint

    t = Taint(exact=4, bits=1 << 16)
    added = [f"page-{i}" for i in range(500)]
    for k in added:
        t.add(k)
    assert t.spilled == 496
    assert all(k in t for k in added)  # no false negative, whatever the order
    others = sum(f"other-{i}" in t for i in range(2000))
    assert others < 100  # a filter of 64 Kbit holds 496 keys with few false positives
    fresh = Taint()
    assert "page-0" not in fresh and 42 not in fresh  # an empty filter answers no
