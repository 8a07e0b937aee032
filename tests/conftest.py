"""Shared test set-up: CUDA tests skip cleanly (with a reason) where torch sees no GPU; hypothesis
profiles: ``ci`` (default, bounded) and ``thorough`` (``HYPOTHESIS_PROFILE=thorough``)."""

import os
import shutil
import subprocess
import time

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def run_cmd(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def mounted(tmp_path):
    """mounted(kind, size_mib) -> a directory on a fresh tmpfs or loop-mounted ext4 of that size."""
    mounts = []

    def make(kind, mib):
        mnt = tmp_path / f"mnt-{kind}-{len(mounts)}"
        mnt.mkdir()
        if kind == "tmpfs":
            r = run_cmd("mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(mnt))
        else:
            img = tmp_path / f"ext4-{len(mounts)}.img"
            with open(img, "wb") as f:
                f.truncate(mib << 20)
            mk = run_cmd("mkfs.ext4", "-q", "-F", str(img))
            if mk.returncode:
                pytest.skip(f"mkfs.ext4 failed: {mk.stderr.strip()}")
            r = run_cmd("mount", "-o", "loop", str(img), str(mnt))
        if r.returncode:
            pytest.skip(f"cannot mount a {kind} here ({r.stderr.strip() or 'mount failed'}): needs root")
        mounts.append(mnt)
        return mnt

    yield make
    for m in reversed(mounts):
        run_cmd("umount", "-l", str(m))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Mooncake cluster on 127.0.0.1 (a master and one storage process), stopped after the module.
    Modules that need another shape define their own ``cluster``."""
    from kvtier.tiers.local_cluster import LocalCluster

    with LocalCluster(storage_nodes=1, segment_bytes=128 << 20, lease_ttl_ms=200, client_ttl_s=2,
                      log_dir=tmp_path_factory.mktemp("cluster-logs")) as c:
        yield c


@pytest.fixture
def managers():
    """vLLM's TieringOffloadingManagers built through its spec factory (tests/vllm_tier.py); every one is shut
    down at the end, and its /dev/shm region must be gone (the tier let go of vLLM's rows)."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    made = []

    def make(cfg):
        spec = OffloadingSpecFactory.create_spec(cfg)
        assert isinstance(spec, TieringOffloadingSpec)
        m = spec.get_manager()
        made.append((m, cfg.engine_id))
        return m

    yield make
    for m, engine in made:
        if getattr(m, "_down", False):
            continue
        m.shutdown()
        assert not os.path.exists(f"/dev/shm/vllm_offload_{engine}.mmap")


def fill_up(mnt):
    """Fills the file system at mnt to the last block with a filler file. A store's background thread may
    still be giving blocks back (an old journal is cut a piece at a time before its close), so the filler
    grows again until the free space stays under 64 KiB across a pause."""
    with open(mnt / "filler", "ab", buffering=0) as f:
        for _ in range(50):
            for n in (1 << 20, 4096, 512):
                try:
                    while True:
                        f.write(b"\0" * n)
                except OSError:
                    pass
            time.sleep(0.05)
            if shutil.disk_usage(mnt).free < (64 << 10):
                return
    raise AssertionError(f"{mnt} never stayed full: {shutil.disk_usage(mnt).free} bytes free")
