"""Every tier implements kvtier.Tier, the interface TierController, the planner and the engine integrations use:
each method with the Protocol's parameters (names, kinds, defaults), checked on the classes without opening a
tier; and a PageStore opened for real passes the runtime check while an object missing one method does not."""

import inspect

import pytest

import kvtier
from kvtier import MooncakeTier, PageStore, Tier, TieredStore

MEMBERS = [n for n in dir(Tier) if not n.startswith("_") and n != "page_bytes"]


def test_the_interface_names_what_the_controller_and_the_chain_call():
    assert set(MEMBERS) == {"register_mem_pool_host", "batch_set_v1", "batch_get_v1", "batch_exists", "exists",
                            "locate", "measured", "delete", "erase_tenant", "clear", "get_stats", "close", "pool", "name"}


@pytest.mark.parametrize("cls", [PageStore, MooncakeTier, TieredStore])
def test_each_tier_implements_every_method_with_the_interfaces_parameters(cls):
    for name in MEMBERS:
        want, got = getattr(Tier, name), getattr(cls, name, None)
        assert got is not None, f"{cls.__name__} lacks {name}"
        if isinstance(want, property):
            # a property, or a class attribute of the right type (PageStore.name = "disk")
            assert isinstance(got, (property, str)), f"{cls.__name__}.{name} is neither a property nor a name"
            continue
        w = [(p.name, p.kind, p.default) for p in inspect.signature(want).parameters.values()]
        g = [(p.name, p.kind, p.default) for p in inspect.signature(got).parameters.values()]
        assert g == w, f"{cls.__name__}.{name}{inspect.signature(got)} differs from Tier.{name}{inspect.signature(want)}"


def test_an_open_store_is_a_tier_and_an_object_missing_a_method_is_not(tmp_path):
    with PageStore(tmp_path, capacity_bytes=1 << 20) as st:
        assert isinstance(st, Tier) and st.page_bytes == 0 and st.pool is None and st.name == "disk"
        assert set(st.measured()) == {st.name}  # the planner costs locate()'s runs by these names

    class NoErase:
        page_bytes, pool, name = 0, None, "x"

    for name in MEMBERS:
        if name not in ("pool", "name", "erase_tenant"):
            setattr(NoErase, name, lambda self, *a, **k: None)
    assert not isinstance(NoErase(), Tier)
    assert kvtier.Tier is Tier
