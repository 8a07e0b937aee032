"""Tenants in the Mooncake cluster tier (a real master and storage processes on 127.0.0.1): no hit across
tenants and hits within one, sealed objects that hold no plaintext under names that show no engine key and no
tenant, a damaged seal, a destroyed tenant key or a record forged for another geometry that is a counted miss
never wrong bytes, another master key that finds nothing, an erased tenant that cannot write again until it is
allowed, and erasure of one tenant's objects from the whole cluster. Loopback only; the cluster is stopped at
the end."""

import struct
import time
import zlib

import pytest
import torch

from kvtier import page_hashes
from kvtier.tenants import Keyring, tenant_keys, tenant_tag
from kvtier.tiers.objects.records import HEAD, OBJ
from kvtier.tiers.mooncake import MooncakeTier
from store_pools import PS, make_pool, page_bytes, pages_idx

pytestmark = pytest.mark.timeout(240)
TOKENS = list(range(7000, 7000 + 8 * PS))


@pytest.fixture(scope="module")
def keyring(tmp_path_factory):
    return Keyring.init(tmp_path_factory.mktemp("keys") / "ring")


def tier(cluster, pool, **kw):
    t = MooncakeTier(cluster.master_address, model_name="org/model", **kw)
    t.register_mem_pool_host(pool)
    return t


def same(hp_a, a, hp_b, b):
    return all(torch.equal(x, y) for x, y in zip(page_bytes(hp_a, a), page_bytes(hp_b, b)))


@pytest.mark.parametrize("sealed", [False, True])
def test_tenants_never_share_a_page_and_one_tenant_does(cluster, keyring, sealed):
    kr = keyring if sealed else None
    src, dst = make_pool(seed=21), make_pool(seed=22)
    alice = page_hashes(TOKENS[: 4 * PS], PS, salt=f"alice-{sealed}")
    bob = page_hashes(TOKENS[: 4 * PS], PS, salt=f"bob-{sealed}")
    with tier(cluster, src, keyring=kr) as a, tier(cluster, dst, keyring=kr) as b:
        assert a.batch_set_v1(alice, pages_idx(range(4))) == [True] * 4
        assert b.batch_exists(bob) == 0 and b.batch_get_v1(bob, pages_idx(range(4))) == [False] * 4
        assert b.batch_exists(alice) == 4  # the same tenant hits, from another client
        assert b.batch_get_v1(alice, pages_idx(range(8, 12))) == [True] * 4
        assert all(same(src, i, dst, 8 + i) for i in range(4))
    # a per-deployment tenant scopes the engine's own keys
    plain = page_hashes(TOKENS[: 2 * PS], PS)
    with tier(cluster, src, keyring=kr, tenant="acme") as a, tier(cluster, dst, keyring=kr) as b:
        assert a.batch_set_v1(plain, pages_idx(range(2))) == [True, True]
        assert b.batch_exists(plain) == 0 and b.batch_exists(tenant_keys("acme", plain)) == 2


def test_sealed_objects_hold_no_plaintext_and_a_damaged_seal_is_a_miss(cluster, keyring):
    src, dst = make_pool(seed=31), make_pool(seed=32)
    keys = page_hashes(TOKENS[: 3 * PS], PS, salt="carol")
    with tier(cluster, src, keyring=keyring) as a, tier(cluster, dst, keyring=keyring) as b:
        assert a.batch_set_v1(keys, pages_idx(range(3))) == [True] * 3
        s = a._store
        assert a.data_keys(keys[0])[0].startswith(f"kvtier-sealed-{keyring.id}_org-model_t")
        for i, key in enumerate(keys):
            for name, plain in zip(a.data_keys(key), page_bytes(src, i)):
                stored, p = s.get(name), plain.numpy().tobytes()
                assert len(stored) == len(p) and stored != p
                for off in (0, len(p) // 2, len(p) - 64):
                    assert p[off: off + 64] not in stored
        # page 0: one bit of its K seal flipped, the record's own checksum fixed: data checksums pass, the tag
        # does not -> a counted corrupt miss, never the ciphertext served as KV
        rk = a._records(a._stored([keys[0]]), create=False)[0]
        assert rk.startswith(a.record_key(keys[0]) + "-")  # sealed: the record names the tenant key's id
        raw = bytearray(s.get(rk))
        raw[HEAD.size + 2 * OBJ.size + 20] ^= 1  # a bit of the K object's tag
        raw[-4:] = struct.pack("<I", zlib.crc32(bytes(raw[:-4])) & 0xFFFFFFFF)
        assert s.upsert(rk, bytes(raw)) == 0
        dst.k_buffer.fill_(0x5A)
        assert b.batch_get_v1(keys, pages_idx(range(3))) == [False, True, True]
        assert same(src, 1, dst, 1) and same(src, 2, dst, 2)
        assert b.get_stats()["corrupt"] == 1
    # another master key names other objects: nothing found
    other = Keyring.init(keyring.path + "-other")
    with tier(cluster, dst, keyring=other) as c:
        assert c.batch_exists(keys) == 0


def test_erase_removes_a_tenant_from_the_cluster_and_its_key(cluster, keyring):
    src, dst = make_pool(seed=41), make_pool(seed=42)
    dave = page_hashes(TOKENS[: 3 * PS], PS, salt="dave")
    erin = page_hashes(TOKENS[: 3 * PS], PS, salt="erin")
    with tier(cluster, src, keyring=keyring) as a, tier(cluster, dst, keyring=keyring) as b:
        assert a.batch_set_v1(dave + erin, pages_idx(range(6))) == [True] * 6
        assert a.erase_tenant("dave") == 3 * 3  # K, V and the record of each page
        assert b.batch_exists(dave) == 0 and b.batch_exists(erin) == 3
        # erin's key destroyed: her objects are still in the cluster, and unreadable
        assert keyring.erase("erin")
        assert all(b._store.is_exist(n) == 1 for k in erin for n in b.data_keys(k))  # still in the cluster
        assert b.batch_exists(erin) == 0 and b.batch_get_v1(erin, pages_idx(range(3))) == [False] * 3
        # erased: her writes are refused (no key is made for her, no object stored) until she is allowed
        more = page_hashes(TOKENS[3 * PS: 5 * PS], PS, salt="erin")
        before = cluster.object_names()
        assert a.batch_set_v1(more + erin, pages_idx(range(5))) == [False] * 5
        assert cluster.object_names() == before and not keyring.has_key("erin")
        assert b.batch_get_v1(more, pages_idx(range(2))) == [False] * 2
        assert keyring.allow("erin")
        # erin writes again: a new key and new records; the old objects are replaced, never opened
        assert a.batch_set_v1(erin, pages_idx(range(3, 6))) == [True] * 3
        assert b.batch_get_v1(erin, pages_idx(range(3))) == [True] * 3
        assert all(same(src, 3 + i, dst, i) for i in range(3))


def test_a_sealed_cluster_shows_no_engine_key_and_no_tenant_and_erases_by_stored_tag(cluster, keyring):
    """What a cluster operator sees (every object name in the cluster) holds no engine key (the token hashes),
    no tenant tag and no salt; the pages come back bit-exact; erasing the tenant removes its objects (named by
    its stored tag) and keeps everyone else's."""
    salt = "hana-48213"
    tokens = list(range(91000, 91000 + 4 * PS))
    engine = page_hashes(tokens, PS)  # the engine's own keys: its token hashes
    hana = page_hashes(tokens, PS, salt=salt)
    plain = page_hashes(list(range(93000, 93000 + 2 * PS)), PS)
    src, dst = make_pool(seed=61), make_pool(seed=62)
    with tier(cluster, src, keyring=keyring) as a, tier(cluster, dst, keyring=keyring) as b:
        before = set(cluster.object_names())
        assert a.batch_set_v1(hana + plain, pages_idx(range(6))) == [True] * 6
        names = cluster.object_names()
        new = set(names) - before
        assert len(new) == 6 * 3  # K, V and the record of each page
        secrets = engine + plain + hana + [k.split(".")[1] for k in hana] + [tenant_tag(salt), salt]
        leaked = [(n, x) for n in names for x in secrets if x in n]
        assert not leaked, leaked[:3]
        stag = keyring.stored_tag(salt)
        assert sum(f"_t{stag}." in n for n in new) == 4 * 3  # the tenant's objects carry its stored tag
        assert b.batch_get_v1(hana + plain, pages_idx(range(8, 14))) == [True] * 6
        assert all(same(src, i, dst, 8 + i) for i in range(6))
        assert a.erase_tenant(salt) == 4 * 3
        left = set(cluster.object_names())
        assert not any(f"_t{stag}." in n for n in left) and len(new & left) == 2 * 3
        assert b.batch_exists(hana) == 0 and b.batch_exists(plain) == 2
        assert b.batch_get_v1(plain, pages_idx(range(2))) == [True] * 2
        assert all(same(src, 4 + i, dst, i) for i in range(2))


def test_a_sealed_object_never_opens_under_a_record_forged_for_another_geometry(cluster, keyring):
    """A record is only checksummed: whoever holds the cluster can write one naming any geometry. The seal
    binds the geometry, so an object sealed for bfloat16 pages paired with a record forged for float16 pages
    (the same object sizes and names) is a counted miss for a float16 reader, never bytes of another layout."""
    keys = page_hashes(list(range(95000, 95000 + 2 * PS)), PS, salt="ines")
    src, same_fp = make_pool(seed=71), make_pool(seed=72)
    other = make_pool(seed=73, dtype=torch.float16)
    with tier(cluster, src, keyring=keyring) as a, tier(cluster, same_fp, keyring=keyring) as a2, \
            tier(cluster, other, keyring=keyring) as b:
        assert a2.page_objects.fp == a.page_objects.fp
        assert a.data_keys(keys[0]) == b.data_keys(keys[0])  # one object name for both geometries
        assert a.page_objects.fp != b.page_objects.fp
        assert a.batch_set_v1(keys, pages_idx(range(2))) == [True, True]
        assert b.batch_get_v1(keys, pages_idx(range(2))) == [False, False]  # the record names A's geometry
        assert b.get_stats()["stale"] == 2
        rk = a._records(a._stored(keys), create=False)
        s = a._store
        for r in rk:  # forged: B's fingerprint, the record's own checksum fixed
            raw = bytearray(s.get(r))
            raw[HEAD.size - 8: HEAD.size] = b.page_objects.fp
            raw[-4:] = struct.pack("<I", zlib.crc32(bytes(raw[:-4])) & 0xFFFFFFFF)
            assert s.upsert(r, bytes(raw)) == 0
        other.k_buffer.view(torch.uint8).fill_(0x5A)
        assert b.batch_get_v1(keys, pages_idx(range(2))) == [False, False]
        assert b.get_stats()["corrupt"] == 2
        # the geometry the objects were sealed for opens them (rewritten with genuine records)
        time.sleep(0.3)  # past the lease of B's reads
        assert a.batch_set_v1(keys, pages_idx(range(2))) == [True, True]
        assert a2.batch_get_v1(keys, pages_idx(range(4, 6))) == [True, True]
        assert all(same(src, i, same_fp, 4 + i) for i in range(2))


def test_the_erase_command_removes_a_tenant_from_the_cluster(cluster, keyring, tmp_path):
    import os
    import subprocess
    import sys

    src, sealed_src = make_pool(seed=51), make_pool(seed=52)
    fay = page_hashes(TOKENS[: 2 * PS], PS, salt="fay")
    gus = page_hashes(TOKENS[: 2 * PS], PS, salt="gus")
    with tier(cluster, src) as a, tier(cluster, sealed_src, keyring=keyring) as b:
        assert a.batch_set_v1(fay + gus, pages_idx(range(4))) == [True] * 4
        assert b.batch_set_v1(fay + gus, pages_idx(range(4))) == [True] * 4
        time.sleep(0.3)  # past the lease of the existence checks
        env = dict(os.environ)
        cmd = [sys.executable, "-m", "kvtier", "erase", "--tenant", "fay", "--cluster", cluster.master_address,
               "--keyring", keyring.path]
        dry = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert dry.returncode == 0 and "would remove" in dry.stdout, dry.stdout + dry.stderr
        assert a.batch_exists(fay) == 2 and b.batch_exists(fay) == 2
        time.sleep(0.3)
        done = subprocess.run(cmd + ["--yes"], capture_output=True, text=True, timeout=120, env=env)
        # the clear objects (named by the tenant's tag) and the sealed ones (by its stored tag): 2 x 6
        assert done.returncode == 0 and "12 object(s) removed" in done.stdout, done.stdout + done.stderr
        assert a.batch_exists(fay) == 0 and a.batch_exists(gus) == 2
        assert b.batch_exists(fay) == 0 and b.batch_exists(gus) == 2
        assert keyring.erased("fay")
