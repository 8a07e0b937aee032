"""Erasure at its edges: a page the engine holds while its tenant is erased, a store whose pool is registered
again after an erase, an erase that stops half way, a salt file an editor saved with a byte-order mark, and
the tenant API's arguments checked before anything runs (docs/SECURITY.md, "Erasure by tenant")."""

import pytest

from kvtier import PageStore, page_hashes
from kvtier._errors import InvalidArgumentError, KvtierError
from kvtier.tenants import Keyring, tenant_of, tenant_tag

from store_pools import PS, make_pool, pages_idx


def test_a_page_held_while_its_tenant_is_erased_is_never_a_hit_and_is_wiped_at_its_release(tmp_path):
    from controller_pools import rows, setup

    dp, hp, st, c = setup(tmp_path, host_pages=6)
    alice = page_hashes(list(range(900, 900 + 2 * 4)), 4, salt="alice")
    c.backup(rows([1, 2]), alice)
    c.wait_idle()
    assert c.acquire(alice[:1]) != []  # the engine holds alice's first page
    held = c.pages[alice[0]].start // 4
    assert c.erase_tenant("alice")["host_in_use"] == 1
    free_before = hp.available_size()
    assert hp.k_buffer[held].any()  # the engine still reads it: untouched while held
    assert c.match(alice) == (0, 0), "a page of an erased tenant was still a host hit"
    assert c.acquire(alice[:1]) == []
    c.release(alice[:1])
    assert alice[0] not in c.pages, "the erased tenant's page stayed indexed after its last release"
    assert not hp.k_buffer[held].any() and not hp.v_buffer[held].any(), "freed without being wiped"
    assert hp.available_size() == free_before + 4
    c.close()
    st.close()


def test_registering_the_pool_again_keeps_an_erased_tenant_refused(tmp_path):
    hp = make_pool(seed=3)
    alice = page_hashes(list(range(2 * PS)), PS, salt="alice")
    bob = page_hashes(list(range(2 * PS)), PS, salt="bob")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(alice, pages_idx([0, 1])))
        assert st.erase_tenant("alice") == 2
        st.register_mem_pool_host(hp)  # a second registration reopens the native store
        assert st.batch_set_v1(alice, pages_idx([0, 1])) == [False, False], "the erased tenant wrote again"
        assert st.batch_exists(alice) == 0
        assert all(st.batch_set_v1(bob, pages_idx([0, 1])))  # the paired assertion: another tenant writes
        assert st.allow_tenant("alice") is True
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(alice, pages_idx([0, 1])))  # allowed: it stays allowed after a reopen


def test_an_erase_that_stops_half_way_says_what_it_did_not_reach(tmp_path, monkeypatch, capsys):
    from kvtier import _tenant_cli, cli

    hp = make_pool(seed=1)
    keys = page_hashes(list(range(2 * PS)), PS, salt="alice")
    for d in ("a", "b"):  # two namespaces: two pools of different page counts
        with PageStore(tmp_path / "s", capacity_bytes=1 << 30, model_name=d) as st:
            st.register_mem_pool_host(hp)
            assert all(st.batch_set_v1(keys, pages_idx([0, 1])))
    real, calls = _tenant_cli._erase_namespace, []

    def failing(path, ns, kr, tag):
        calls.append(ns)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real(path, ns, kr, tag)

    monkeypatch.setattr(_tenant_cli, "_erase_namespace", failing)
    assert cli.main(["erase", str(tmp_path / "s"), "--tenant", "alice", "--yes"]) == 1
    err = capsys.readouterr().err
    assert "not erased" in err and "Run the same command again" in err, err
    assert err.count("namespace ") == 1, err  # only the one it did not reach
    monkeypatch.setattr(_tenant_cli, "_erase_namespace", real)
    assert cli.main(["erase", str(tmp_path / "s"), "--tenant", "alice", "--yes"]) == 0
    out = capsys.readouterr().out  # the second run erases what the first did not reach: K and V of 2 pages
    assert out.count("erased 4 object(s) in") == 1 and "model=b" in out, out


def test_a_salt_file_with_a_byte_order_mark_names_the_same_tenant(tmp_path, capsys):
    from kvtier import cli

    (tmp_path / "s").mkdir()
    f = tmp_path / "salt"
    f.write_text("\ufeffalice\r\n", encoding="utf-8")
    assert cli.main(["erase", str(tmp_path / "s"), "--tenant-file", str(f)]) == 0
    assert f"tenant {tenant_tag('alice')}" in capsys.readouterr().out


def test_the_tenant_api_checks_its_arguments_by_name(tmp_path):
    with pytest.raises(InvalidArgumentError, match="`salt`.*surrogate"):
        tenant_tag("al\ud800ice")
    with pytest.raises(InvalidArgumentError, match="`salt`"):
        page_hashes([1, 2, 3, 4], 4, salt="\udfff")
    for bad in (1, None, ""):
        with pytest.raises(InvalidArgumentError, match="`keyring`"):
            Keyring.init(bad)
    assert not any(tmp_path.iterdir())
    kr = Keyring.init(tmp_path / "k")
    for bad in (None, "abc", b"abc", 7):
        with pytest.raises(InvalidArgumentError, match="`keys`"):
            kr.stored_names(bad)
    with pytest.raises(InvalidArgumentError, match="`key`"):
        tenant_of(1)
    st = PageStore(tmp_path / "s", capacity_bytes=1 << 30)
    for call in (st.erase_tenant, st.allow_tenant):  # not registered: said first, whatever the arguments
        with pytest.raises(KvtierError, match="register_mem_pool_host"):
            call(1)
    st.close()
