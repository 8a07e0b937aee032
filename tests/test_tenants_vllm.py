"""Tenants through the real vLLM (as installed by `make test`): vLLM mixes a request's cache_salt into its block
hashes, kvtier keys rows by those hashes unchanged, so two salts never share a row while one salt does; a
deployment's tenant and keyring scope and seal the rows. These tests do not skip."""

import numpy as np
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.request import Request

from kvtier.tenants import Keyring, tenant_keys
from vllm_tier import load, offloading_config, random_rows, shutdown, store

TOKENS = list(range(100, 100 + 3 * 16))


def offload_keys(salt):
    """vLLM's own block hashes of TOKENS for a request with ``cache_salt=salt``, as its offloading connector
    turns them into OffloadKeys (group 0)."""
    init_none_hash(sha256)
    req = Request("r-" + str(salt), TOKENS, SamplingParams(max_tokens=1), None, cache_salt=salt,
                  block_hasher=get_request_block_hasher(16, sha256))
    assert len(req.block_hashes) == 3
    return [make_offload_key(h, 0) for h in req.block_hashes]


def tier_lookup(m, ks):
    tier = m.secondary_tiers[0]
    ctx = ReqContext(req_id="probe")
    return [tier.lookup(k, ctx) for k in ks]


def test_vllm_salts_never_share_a_row_and_one_salt_does(tmp_path, managers):  # noqa: F811
    alice, bob, none = offload_keys("alice"), offload_keys("bob"), offload_keys(None)
    assert len({*alice, *bob, *none}) == 9  # the salt changes every block hash (chained from the first)
    m = managers(offloading_config(tmp_path))
    data = random_rows(m, 3, seed=1)
    store(m, alice, data)
    tier = m.secondary_tiers[0]
    # kvtier keeps vLLM's salted hash as the row's key (nothing stripped)
    assert {k.rsplit(".", 1)[0] for k in tier.store.native_store().keys()} == {k.hex() for k in alice}
    assert tier_lookup(m, bob) == [LookupResult.MISS] * 3 and tier_lookup(m, none) == [LookupResult.MISS] * 3
    assert tier_lookup(m, alice) == [LookupResult.HIT] * 3
    shutdown(m)
    m2 = managers(offloading_config(tmp_path))  # a restarted server: only the CPU tier is empty
    got, res = load(m2, alice)
    assert res == [LookupResult.HIT] * 3 and all(np.array_equal(got[k], d.view(np.uint8)) or
                                                  np.array_equal(got[k].view(np.int8), d) for k, d in zip(alice, data))
    got, res = load(m2, bob)
    assert not got


def test_vllm_deployment_tenant_and_keyring(tmp_path, managers):  # noqa: F811
    Keyring.init(tmp_path / "keys")
    ks = offload_keys(None)
    m = managers(offloading_config(tmp_path, tenant="acme", keyring=str(tmp_path / "keys")))
    data = random_rows(m, 3, seed=2)
    store(m, ks, data)
    tier = m.secondary_tiers[0]
    scoped = tenant_keys("acme", [k.hex() for k in ks])
    names = set(Keyring(tmp_path / "keys").stored_names([f"{k}.{side}" for k in scoped for side in ("k", "v", "kv")]))
    assert set(tier.store.native_store().keys()) <= names and len(tier.store.native_store().keys()) >= 3
    assert "|sealed=" in tier.store.namespace_for(None)
    assert tier_lookup(m, ks) == [LookupResult.HIT] * 3
    shutdown(m)
    other = managers(offloading_config(tmp_path, tenant="globex", keyring=str(tmp_path / "keys")))
    assert tier_lookup(other, ks) == [LookupResult.MISS] * 3
    shutdown(other)
    again = managers(offloading_config(tmp_path, tenant="acme", keyring=str(tmp_path / "keys")))
    got, res = load(again, ks)
    assert res == [LookupResult.HIT] * 3
    assert all(np.array_equal(got[k].view(np.int8), d) for k, d in zip(ks, data))
