"""kvtier.namespace: the one namespace type writes the strings the builders wrote before it (store
directories, Mooncake fingerprints and vLLM row stores keep their names), and reads them back."""

from __future__ import annotations

import hashlib
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import InvalidArgumentError
from kvtier.namespace import Namespace, fields_of, rank_fields


def _pool(mla: bool = False, **kw: object) -> types.SimpleNamespace:
    geo = {"kv_lora_rank": 512, "qk_rope_head_dim": 64} if mla else {"head_num": 8, "head_dim": 128}
    return types.SimpleNamespace(layout="page_first", page_size=64, layer_num=32, start_layer=4, **geo, **kw)


def _ranks(dp: int = 0, dcp: tuple[int, int] = (0, 1)) -> dict[str, tuple[int, int]]:
    return {"tp": (1, 4), "pp": (0, 2), "cp": (0, 1), "dp": (dp, 2), "dcp": dcp}


def _heads(pool: types.SimpleNamespace) -> str:
    if getattr(pool, "kv_lora_rank", None) is not None:
        return f"mla={pool.kv_lora_rank}+{pool.qk_rope_head_dim}"
    return f"heads={pool.head_num}|k={pool.head_dim}|v={getattr(pool, 'v_head_dim', None) or pool.head_dim}"


def _old_store(model: str, r: dict, dtype: str, pool: types.SimpleNamespace, sealed: str | None) -> str:
    """PageStore.namespace_for as it was written before kvtier.namespace."""
    extra = (f"|dp={r['dp'][0]}" if r["dp"][0] else "") + (
        f"|dcp={r['dcp'][0]}/{r['dcp'][1]}" if r["dcp"][1] > 1 else "")
    return (f"kvtier-v1|model={model}|tp={r['tp'][0]}/{r['tp'][1]}|pp={r['pp'][0]}/{r['pp'][1]}"
            f"|cp={r['cp'][0]}/{r['cp'][1]}{extra}|dtype={dtype}|layout={pool.layout}"
            f"|page={pool.page_size}|layers={pool.layer_num}|{_heads(pool)}"
            + (f"|sealed={sealed}" if sealed is not None else ""))


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("dp,dcp", [(0, (0, 1)), (1, (0, 1)), (0, (1, 2)), (3, (1, 4))])
@pytest.mark.parametrize("sealed", [None, "kr-0123"])
def test_store_namespace_is_byte_identical(mla: bool, dp: int, dcp: tuple[int, int], sealed: str | None) -> None:
    from kvtier.store import PageStore

    pool = _pool(mla)
    model = "org/Model-7B" + ("|mla" if mla else "")
    store = types.SimpleNamespace(model_name=model, ranks=_ranks(dp, dcp), dtype_of=lambda p: "bfloat16",
                                  keyring=types.SimpleNamespace(id=sealed) if sealed else None)
    text = PageStore.namespace_for(store, pool)  # type: ignore[arg-type]
    assert text == _old_store(model, _ranks(dp, dcp), "bfloat16", pool, sealed)
    ns = Namespace.parse(text)
    assert ns.format() == text and str(ns) == text and Namespace.parse(ns.format()) == ns
    assert ns.model == model and ns.sealed == sealed and ns.mla == mla
    assert ns.get("dp") == (str(dp) if dp else None)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("sealed", [None, "kr-9"])
def test_mooncake_fingerprint_is_byte_identical(mla: bool, sealed: str | None) -> None:
    from kvtier.tiers.objects.pages import PageObjects

    pool = _pool(mla, dtype="bfloat16")
    layout = (0, 4096, 4096, 0, 0, 0) if mla else (0, 8192, 4096, 4096, 8192, 4096)
    ranks = {"tp": (1, 4), "pp": (1, 2), "cp": (0, 1)}
    po = PageObjects(pool, layout, 8, prefix="p", model_name="m", key_tag="t|x", ranks=ranks,
                     kv_cache_dtype="bfloat16", sealed=sealed, scheme="kvtier-mooncake-v1",
                     seal_scheme="kvtier-mooncake-seal-v1")
    tp, pp, cp = ranks["tp"], ranks["pp"], ranks["cp"]
    named = (f"pp={pp[0]}/{pp[1]}" if mla else f"tp={tp[0]}/{tp[1]}|pp={pp[0]}/{pp[1]}") + f"|cp={cp[0]}/{cp[1]}"
    old = (f"kvtier-mooncake-v1|model=m|key_tag={'t|x'!r}|suffix={po.suffix}|{named}"
           f"|start_layer=4|dtype=bfloat16|layout=page_first|page=64|layers=32|{_heads(pool)}"
           f"|objects={layout[2]},{layout[5]}" + (f"|sealed={sealed}" if sealed is not None else ""))
    assert po.fingerprint_text == old
    assert po.aad == "kvtier-mooncake-seal-v1:" + hashlib.sha256(old.encode()).hexdigest()


def test_build_leaves_out_none_and_appends() -> None:
    ns = Namespace.build("kvtier-v1", model="m", **rank_fields(_ranks()), dtype="fp8")
    assert ns.format() == "kvtier-v1|model=m|tp=1/4|pp=0/2|cp=0/1|dtype=fp8"
    assert ns.with_fields(bufs="a:1", objs="flat:3", sealed=None).format() == ns.format() + "|bufs=a:1|objs=flat:3"
    assert rank_fields(_ranks(), tp=(0, 1))["tp"] == "0/1"
    assert fields_of("heads=8|k=128|v=64") == {"heads": "8", "k": "128", "v": "64"}
    assert Namespace.parse("kvtier-vllm-v1|model=m|tag=|groups=0:16:None:2:ab,1:16:4:2:cd").get("tag") == ""


@pytest.mark.parametrize("text", ["", "model=m|tp=0/1", "|model=m", "kvtier-v1|bare", "kvtier-v1|=x", None, 7])
def test_parse_rejects_what_is_not_a_namespace(text: object) -> None:
    with pytest.raises(InvalidArgumentError, match="`text`"):
        Namespace.parse(text)  # type: ignore[arg-type]
    assert Namespace.parse_or_none(text) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("scheme,fields,arg", [("", (), "scheme"), ("a|b", (), "scheme"), ("s", (("", "v"),), "fields"),
                                               ("s", (("a=b", "v"),), "fields"), ("s", (("k", 3),), "fields")])
def test_namespace_rejects_bad_parts(scheme: str, fields: tuple, arg: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"`{arg}`"):
        Namespace(scheme, fields)


def test_cli_readers_see_model_and_seal() -> None:
    from kvtier._store_cli import model_of, names_model
    from kvtier._tenant_cli import _sealed_id

    text = "kvtier-v1|model=m|mla|tp=0/1|pp=0/1|cp=0/1|mla=512+64|sealed=kr-1"
    assert model_of(text) == "m" and names_model(text, "m") and names_model(text, "m|mla")
    assert not names_model(text, "m2") and model_of(None) is None and model_of("junk|x") is None
    assert _sealed_id(text) == "kr-1" and _sealed_id("kvtier-v1|model=m") is None


def test_ranks_travel_as_one_value(tmp_path) -> None:
    from kvtier import PageStore
    from kvtier.namespace import Ranks

    r = Ranks(tp_rank=1, tp_size=4, pp_rank=1, pp_size=2, dp_rank=3, dcp_rank=1, dcp_size=2)
    a = PageStore(str(tmp_path), ranks=r)
    b = PageStore(str(tmp_path), tp_rank=1, tp_size=4, pp_rank=1, pp_size=2, dp_rank=3, dcp_rank=1, dcp_size=2)
    assert a.ranks == b.ranks == r.table()
    assert Ranks.pick(None, tp_rank=2, tp_size=3) == (2, 3)
    assert Ranks.pick(Ranks(tp_rank=1, tp_size=2), tp_rank=0, tp_size=1) == (1, 2)
    with pytest.raises(InvalidArgumentError, match="`tp_rank`: pass `ranks` or the rank keywords"):
        PageStore(str(tmp_path), ranks=r, tp_rank=1, tp_size=4)
    with pytest.raises(InvalidArgumentError, match="`ranks`: dp_rank is not a rank of this tier"):
        Ranks.pick(Ranks(dp_rank=1), tp_rank=0, tp_size=1)
    with pytest.raises(InvalidArgumentError, match="`ranks`"):
        PageStore(str(tmp_path), ranks={"tp": (0, 1)})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="`tp_rank`"):
        Ranks(tp_rank=4, tp_size=4)
    with pytest.raises(InvalidArgumentError, match="`dp_rank`"):
        Ranks(dp_rank=-1)


def test_build_tier_by_name(tmp_path) -> None:
    from kvtier import PageStore
    from kvtier.namespace import Ranks
    from kvtier.tier import TIERS, build_tier

    t = build_tier({"disk": {"path": str(tmp_path), "ranks": Ranks(tp_rank=1, tp_size=2)}}, model_name="m")
    assert isinstance(t, PageStore) and t.model_name == "m" and t.ranks["tp"] == (1, 2)
    assert isinstance(build_tier("disk", path=str(tmp_path)), PageStore)
    with pytest.raises(InvalidArgumentError, match="unknown tier 'no-such-tier'; registered tiers: (.*, )?disk, (.*, )?mooncake"):
        build_tier("no-such-tier")  # (the built-in tiers in order, any other registered one among them)
    with pytest.raises(InvalidArgumentError, match="needs `path`"):
        build_tier("disk")
    for bad in ({"disk": {}, "mooncake": {}}, {"disk": 1}, 3):
        with pytest.raises(InvalidArgumentError, match="`spec`"):
            build_tier(bad)  # type: ignore[arg-type]
    assert {"disk", "mooncake"} <= set(TIERS)  # (a deployment may register more: docs/ARCHITECTURE.md)


def test_a_value_may_hold_a_bare_equals_and_none_is_written_as_before() -> None:
    from kvtier._tenant_cli import _sealed_id

    text = "kvtier-v1|model=org/M|=x|tp=0/1|sealed=kr-1"
    ns = Namespace.parse(text)
    assert ns.model == "org/M|=x" and ns.format() == text and _sealed_id(text) == "kr-1"
    assert Namespace.build("kvtier-v1", model="m", page=str(None)).format() == "kvtier-v1|model=m|page=None"


@pytest.mark.parametrize("model", ["m|sealed=kr-1", "org/M|tp=9/9", "a|b|c=d", "x|mla|sealed=k",
                                   "m)\nkept ns-0000: forged line (", "m\x1b[2K", "m\x7f"])
def test_a_value_that_would_read_back_as_a_field_is_refused(model: str, tmp_path) -> None:
    from kvtier import PageStore
    with pytest.raises(InvalidArgumentError, match="`fields`.*'model'"):
        Namespace.build("kvtier-v1", model=model, tp="0/1")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(InvalidArgumentError, match="`model_name`"):
        PageStore(str(tmp_path / "s"), model_name=model)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@given(st.lists(st.tuples(st.text("ab=|", min_size=1, max_size=4).filter(lambda k: "|" not in k and "=" not in k),
                          st.text("ab=|x", max_size=8)), max_size=4))
def test_every_namespace_that_can_be_made_reads_back_as_itself(fields: list[tuple[str, str]]) -> None:
    try:
        ns = Namespace("kvtier-v1", tuple(fields))
    except InvalidArgumentError:
        return
    assert Namespace.parse(ns.format()) == ns


def test_a_namespace_kvtier_never_writes_does_not_parse() -> None:
    """Each key once and the seal last, as every builder writes: a clear store whose model name planted
    ``|sealed=k`` before names were checked is not read as sealed (the CLI keeps it and names it)."""
    from kvtier._tenant_cli import _sealed_id

    planted = "kvtier-v1|model=m|sealed=kr-1|tp=0/1|pp=0/1|cp=0/1|dtype=bfloat16"
    for text in (planted, "kvtier-v1|model=m|tp=0/1|tp=0/2", "kvtier-v1|model=m|sealed=a|sealed=b"):
        with pytest.raises(InvalidArgumentError, match="`text`.*not a namespace kvtier writes"):
            Namespace.parse(text)
        assert Namespace.parse_or_none(text) is None and _sealed_id(text) is None
    for fields in ((("model", "m"), ("model", "n")), (("sealed", "k"), ("tp", "0/1"))):
        with pytest.raises(InvalidArgumentError, match="`fields`: each key once and `sealed` last"):
            Namespace("kvtier-v1", fields)
    assert Namespace.parse("kvtier-v1|model=m|tp=0/1|sealed=kr-1").sealed == "kr-1"


def test_a_model_is_named_by_itself_or_its_mla_name_only() -> None:
    from kvtier._store_cli import names_model

    base = "|tp=0/1|pp=0/1|cp=0/1"
    assert names_model("kvtier-v1|model=M" + base, "M") and names_model("kvtier-v1|model=M|mla" + base, "M")
    assert not names_model("kvtier-v1|model=M|draft" + base, "M")
    assert not names_model("kvtier-v1|model=M-other" + base, "M")


@pytest.mark.parametrize("arg,value", [("model_name", "m|sealed=k"), ("key_tag", "t|tp=1/2")])
def test_the_cluster_tier_refuses_a_planted_field_before_anything_opens(arg: str, value: str) -> None:
    from kvtier.tiers._mooncake_options import validate_options

    kw = {"master_server_address": "127.0.0.1:50051", "model_name": "m", arg: value}
    with pytest.raises(InvalidArgumentError, match=f"`{arg}`"):
        validate_options(**kw)
