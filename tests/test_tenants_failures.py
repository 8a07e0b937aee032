"""Tenants and encryption at rest when things go wrong around them: a key file unreadable for a moment, an
erasure racing a writer's key creation, a write-back after an erasure, cluster pages two writers interleaved,
a key rotation. Each test states what docs/SECURITY.md promises."""

import os
import subprocess
import sys
import textwrap


import kvtier
from kvtier import PageStore, page_hashes
from kvtier.tenants import Keyring, tenant_tag

from store_pools import PS, make_pool, pages_idx

TOKENS = list(range(5000, 5000 + 8 * PS))
HERE = os.path.dirname(__file__)


def _run(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env)


# --- R1: a key file unreadable for a moment, during a WRITE, destroys the tenant's key -------------------------
# SECURITY.md: "A tenant whose key is not there (erased, or its key file unreadable for a moment) is a miss that
# keeps its pages". A write batch that cannot read the key file (here: EMFILE, the process out of descriptors
# for a moment) removes it (seal.rs tenant_key: `if p.exists() && read().is_none() { remove_file }`), so every
# page the tenant has, in every namespace, process and node sharing the keyring, is unreadable for good.


def test_a_key_file_unreadable_for_a_moment_during_a_write_keeps_the_tenants_key(tmp_path):
    r = _run(f"""
        import os, resource
        from kvtier import PageStore, page_hashes
        from kvtier.tenants import Keyring, tenant_tag
        from store_pools import PS, make_pool, pages_idx
        kr = Keyring.init({str(tmp_path / 'keys')!r})
        hp = make_pool()
        keys = page_hashes(list(range(5000, 5000 + 4 * PS)), PS, salt="alice")
        kf = os.path.join(kr.path, "tenants", kr.stored_tag("alice") + ".key")
        with PageStore({str(tmp_path / 's')!r}, capacity_bytes=1 << 30, keyring=kr) as st:
            st.register_mem_pool_host(hp)
            assert st.batch_set_v1(keys[:2], pages_idx(range(2))) == [True, True]
            before = open(kf).read()
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            n = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (n + 8, hard))
            held = []
            try:
                while True:
                    held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            try:
                st.batch_set_v1(keys[2:3], pages_idx(range(2, 3)))   # the descriptor shortage: one batch
            finally:
                for fd in held:
                    os.close(fd)
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            print("KEYFILE", os.path.exists(kf) and open(kf).read() == before)
            print("EXISTS", st.batch_exists(keys[:2]))
    """)
    assert "KEYFILE" in r.stdout, r.stdout + r.stderr
    assert "KEYFILE True" in r.stdout and "EXISTS 2" in r.stdout, r.stdout


# --- R2: erase while another process writes the tenant's first page: the erase fails with an OS error --------
# seal.rs erase_tenant overwrites the key file with 65 zero bytes, then removes it. A writer that reads the file
# in between finds it unparsable, removes it and links a new key (tenant_key's "damaged file" branch); the
# erase's remove_file then fails (NotFound: "removing .../<tag>.key") or removes the writer's NEW key.


def test_erase_racing_a_writers_key_creation_neither_fails_nor_removes_the_new_key(tmp_path):
    import threading

    Keyring.init(tmp_path / "keys")
    eraser, writer = Keyring(tmp_path / "keys"), Keyring(tmp_path / "keys")  # two processes' keyrings
    tag = tenant_tag("alice")
    errors, stop = [], threading.Event()

    def write():
        while not stop.is_set():
            writer.native.key_ids([tag], True)  # what a sealed put does first

    t = threading.Thread(target=write)
    t.start()
    try:
        for _ in range(3000):
            try:
                eraser.erase(tag=tag)
            except OSError as e:
                errors.append(repr(e))
    finally:
        stop.set()
        t.join()
    assert not errors, f"{len(errors)} erasures failed, e.g. {errors[0]}"


# --- R3: TierController.erase_tenant, write_back: a page in use at the erasure is spilled to disk afterwards ----
# SECURITY.md tells a running server to erase through TierController.erase_tenant. A page the engine held at that
# moment is kept ("host_in_use"), and under write_back its eviction later spills it (controller.py
# _evict_locked): the erased tenant's KV is back on disk, under a freshly created key.


def test_write_back_never_spills_a_page_of_an_erased_tenant(tmp_path):
    from controller_pools import rows, setup

    kr = Keyring.init(tmp_path / "keys")
    dp, hp, _, _ = setup(tmp_path / "unused", store=False)
    st = PageStore(tmp_path / "s", capacity_bytes=1 << 26, keyring=kr)
    st.register_mem_pool_host(hp)
    c = kvtier.TierController(dp, hp, st, write_policy="write_back")
    alice = page_hashes(list(range(500, 508)), 4, salt="alice")
    c.backup(rows([1, 2]), alice)
    c.wait_idle()
    assert c.acquire(alice[:1])  # the engine is using alice's first page
    got = c.erase_tenant("alice")
    assert got["host_in_use"] == 1
    kr.erase("alice")  # and its key, as `kvtier erase --keyring` does
    c.release(alice[:1])
    for n in range(8):  # other traffic evicts the host pages
        c.backup(rows([3 + n % 4]), page_hashes(list(range(900 + 4 * n, 904 + 4 * n)), 4, salt="bob"))
        c.wait_idle()
    try:
        assert not kr.has_key("alice"), "a new key was created for the erased tenant"
        assert st.batch_exists(alice[:1]) == 0, "the erased tenant's page is back on disk"
    finally:
        c.close()
        st.close()


# --- R4: cluster: a page whose record and data objects come from two different seals is a hit that never reads --
# Sealed cluster pages are upserted object by object (data, then record). When two writers' seals of one page
# mix (two nodes writing a common prefix page at once; or two nodes with their own tenant key file, the case
# SECURITY.md "Many nodes" describes), the record under one writer's name vouches for the other's ciphertext:
# batch_exists counts it (mooncake.py _exists: names only), every get is a counted `corrupt` miss, and the next
# batch_set_v1 skips it as "already there whole with a record" (mooncake.py _set) — the page never heals.


def _tier(cluster, pool, **kw):
    from kvtier.tiers.mooncake import MooncakeTier

    t = MooncakeTier(cluster.master_address, model_name="review/model", **kw)
    t.register_mem_pool_host(pool)
    return t


def test_cluster_node_with_its_own_tenant_key_file_leaves_a_page_that_heals(cluster, tmp_path):
    import shutil

    a_ring = Keyring.init(tmp_path / "a")
    os.makedirs(tmp_path / "b" / "tenants", mode=0o700)
    shutil.copy(tmp_path / "a" / "master.key", tmp_path / "b" / "master.key")  # the same master key, copied
    os.chmod(tmp_path / "b" / "master.key", 0o600)
    b_ring = Keyring(tmp_path / "b")
    src, dst = make_pool(seed=31), make_pool(seed=32)
    keys = page_hashes(TOKENS[:PS], PS, salt="carol-r4a")
    with _tier(cluster, src, keyring=a_ring) as a, _tier(cluster, dst, keyring=b_ring) as b:
        assert a.batch_set_v1(keys, pages_idx([0])) == [True]
        assert b.batch_set_v1(keys, pages_idx([1])) == [True]  # node b: its own key, same object names
        promised = a.batch_exists(keys)
        got = a.batch_get_v1(keys, pages_idx([2]))
        again = a.batch_set_v1(keys, pages_idx([0]))  # a's own write: should make the page readable again
        healed = a.batch_get_v1(keys, pages_idx([3]))
    assert (promised, got, again, healed) == (0, [False], [True], [True]) or (promised, healed) == (1, [True]), \
        f"lookup said {promised}, the read gave {got}; a's put said {again}, then the read gave {healed}"


def test_cluster_two_writers_of_one_sealed_page_at_once_leave_a_page_that_heals(cluster, tmp_path):
    """The same keyring on both nodes (the deployment SECURITY.md asks for). The interleaving: both see the page
    absent; a's objects land, then b's data objects, then a's record last (b's record overwritten by it)."""
    kr = Keyring.init(tmp_path / "k")
    src, dst = make_pool(seed=41), make_pool(seed=42)
    keys = page_hashes(TOKENS[:PS], PS, salt="dave-r4b")
    with _tier(cluster, src, keyring=kr) as a, _tier(cluster, dst, keyring=kr) as b:
        real = b._store

        class Proxy:  # the Mooncake client's methods are read-only: interpose on the object instead
            def __getattr__(self, name):
                return getattr(real, name)

        b._store = Proxy()
        real_upsert = real.batch_upsert_from

        def data_only(names, ptrs, sizes, cfg):  # b's record upsert is the one a's overwrote
            n = len(names) - 1
            return list(real_upsert(names[:n], ptrs[:n], sizes[:n], cfg)) + [0]

        assert a.batch_set_v1(keys, pages_idx([0])) == [True]
        b._store.batch_is_exist = lambda names: [0] * len(names)  # b looked before a's objects landed
        b._store.batch_upsert_from = data_only
        try:
            b.batch_set_v1(keys, pages_idx([1]))
        finally:
            b._store = real
        promised = b.batch_exists(keys)
        first = b.batch_get_v1(keys, pages_idx([2]))
        b.batch_set_v1(keys, pages_idx([1]))  # the engine recomputed the page and writes it back
        after = b.batch_get_v1(keys, pages_idx([3]))
    assert not (promised == 1 and first == [False] and after == [False]), \
        "the page is a lookup hit, a corrupt read, and a write-back that does not heal it"


# --- R5: the rotation recipe removes only the old keyring's namespaces -------------------------------------------
# SECURITY.md "Key rotation": find the old namespaces by their `|sealed=<old id>` with `kvtier namespaces`, remove
# those directories by name (`--model` would select the new keyring's too).


def test_rotation_recipe_removes_only_the_old_keyrings_namespaces(tmp_path):
    import json

    old, new = Keyring.init(tmp_path / "old"), Keyring.init(tmp_path / "new")
    hp = make_pool()
    keys = page_hashes(TOKENS[: 2 * PS], PS)
    for kr in (old, new):
        with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=kr, model_name="m") as st:
            st.register_mem_pool_host(hp)
            assert st.batch_set_v1(keys, pages_idx(range(2))) == [True, True]
    listed = subprocess.run([sys.executable, "-m", "kvtier", "namespaces", str(tmp_path / "s"), "--json"],
                            capture_output=True, text=True, timeout=120)
    info = json.loads(listed.stdout)
    olds = [e["dir"] for e in info["namespaces"] if (e["namespace"] or "").endswith(f"|sealed={old.id}")]
    assert len(olds) == 1
    r = subprocess.run([sys.executable, "-m", "kvtier", "remove", str(tmp_path / "s"), *olds, "--yes"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=new, model_name="m") as st:
        st.register_mem_pool_host(hp)
        assert st.batch_exists(keys) == 2  # the new keyring's pages stay
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=old, model_name="m") as st:
        st.register_mem_pool_host(hp)
        assert st.batch_exists(keys) == 0
