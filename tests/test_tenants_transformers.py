"""Tenants through the transformers cache: a request's cache_salt keys its pages for that tenant alone, on the
host and on a sealed disk; the same tenant restores them (bit-exact with transformers reusing the prefix), the
other tenant recomputes; decode pages adopted after the prompt chain the salt too."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.tenants import Keyring, tenant_keys, tenant_tag  # noqa: E402
from test_transformers import KVTier, PS, gen, llama, prompt, reused, same  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return llama()


def test_a_salted_prefix_is_restored_for_its_tenant_only(model, tmp_path):
    Keyring.init(tmp_path / "keys")
    p1 = prompt(45)
    p2 = prompt(45)  # the same prompt, asked by another tenant and by the first one again
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512, store_dir=tmp_path / "s",
                keyring=tmp_path / "keys") as tier:
        want = gen(model, p1, tier.cache(p1, cache_salt="alice"))
        tier.controller.wait_idle()
        bob = tier.cache(p2, cache_salt="bob")
        assert bob.restored_tokens == 0  # another tenant: nothing restored, from host or disk
        assert torch.equal(gen(model, p2, bob)[0], want[0])
        plain = tier.cache(p2)
        assert plain.restored_tokens == 0  # no salt is a tenant of its own
        gen(model, p2, plain)
        again = tier.cache(p2, cache_salt="alice")
        assert again.restored_host_pages == 5  # the paired assertion: the same tenant hits
        assert same(gen(model, p2, again), reused(model, p1, p2, 40))
        tier.controller.wait_idle()
        keys = set(tier.controller.pages)
        assert any(k.startswith("t" + tenant_tag("alice")) for k in keys)
        assert any(k.startswith("t" + tenant_tag("bob")) for k in keys)
        del bob, plain, again  # (a live cache holds its pages on the host)
        assert tier.drop_host_copies() > 0
        disk = tier.cache(p2, cache_salt="alice")
        assert disk.restored_store_pages == 5  # from the sealed disk
        assert same(gen(model, p2, disk), reused(model, p1, p2, 40))
        with pytest.raises(Exception, match="cache_salt"):
            tier.cache(p1, cache_salt="")


def test_pages_adopted_after_the_prompt_are_the_tenants_and_chain_like_unsalted_ones(model):
    p1 = prompt(20)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512) as tier:
        seq, _ = gen(model, p1, tier.cache(p1, cache_salt="carol"), n=12)  # 32 tokens: 3 full pages adopted
        tier.controller.wait_idle()
        from kvtier import page_hashes

        full = seq[0].tolist()[: (len(seq[0]) - 1) // PS * PS]
        want = tenant_keys("carol", page_hashes(full, PS))
        assert tier.controller.match(want)[0] == len(want)  # keyed exactly as a salted restore looks them up
        assert tier.controller.match(page_hashes(full, PS))[0] == 0
