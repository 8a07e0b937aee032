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


@pytest.mark.parametrize("fails", [False, True])
def test_a_page_whose_last_hold_is_a_load_is_wiped_when_the_load_ends(tmp_path, fails):
    """The engine's hold ends through a load (not release), one that completes or one that fails: the erased
    tenant's page is wiped and freed as the load ends, with no other call in between."""
    import threading

    from controller_pools import rows, setup

    dp, hp, st, c = setup(tmp_path, host_pages=6)
    alice = page_hashes(list(range(700, 700 + 4)), 4, salt="alice")
    c.backup(rows([1]), alice)
    c.wait_idle()
    start = c.pages[alice[0]].start // 4
    started, go, real = threading.Event(), threading.Event(), c.loader.load

    def stalled(*args, **kwargs):
        started.set()
        assert go.wait(30)
        if fails:
            raise OSError(5, "the copy failed")
        return real(*args, **kwargs)

    c.loader.load = stalled
    raised = []

    def load():
        try:
            c.load(alice, rows([9]))
        except OSError:
            raised.append(True)

    loading = threading.Thread(target=load)
    loading.start()
    assert started.wait(30)
    assert c.erase_tenant("alice")["host_in_use"] == 1
    go.set()
    loading.join(30)
    assert raised == ([True] if fails else [])
    assert alice[0] not in c.pages, "the erased tenant's page stayed indexed after the load that held it"
    assert not hp.k_buffer[start].any() and not hp.v_buffer[start].any()
    c.close()
    st.close()


@pytest.mark.parametrize("verified", [True, False])
def test_a_prefetch_racing_an_erase_leaves_no_page_of_the_tenant(tmp_path, verified):
    """A prefetch of the tenant's pages whose store read finished before the erase and whose page lands in the
    host after it: never a hit, wiped and freed when the prefetch lets go of it; also when the read then fails
    its check (what it wrote into host memory is wiped too)."""
    import threading

    from controller_pools import rows, setup

    dp, hp, st, c = setup(tmp_path, host_pages=6)
    alice = page_hashes(list(range(600, 600 + 2 * 4)), 4, salt="alice")
    c.backup(rows([1, 2]), alice)
    c.wait_idle()
    assert c.evict_unreferenced() == 2 and st.batch_exists(alice) == 2
    read, go, real_get = threading.Event(), threading.Event(), st.batch_get_v1

    def get_then_wait(*args, **kwargs):
        got = real_get(*args, **kwargs)  # the tenant's bytes are in host memory now
        read.set()
        assert go.wait(30)
        return got if verified else [False] * len(got)

    st.batch_get_v1 = get_then_wait
    real_idle = c.wait_idle

    def idle_then_prefetch():
        real_idle()
        c.wait_idle = real_idle
        c._pending.clear()  # (the erase does not wait for this one: it runs beside the erase)
        threading.Thread(target=lambda: c.prefetch(alice)).start()
        assert read.wait(30)

    c.wait_idle = idle_then_prefetch
    got = c.erase_tenant("alice")
    assert got["host_in_use"] == 2 and got["store"] == 2
    assert c.match(alice) == (0, 0)
    slots = [c.pages[k].start // 4 for k in alice]
    go.set()
    c.wait_idle()
    c.match(alice)  # any later call settles what finished meanwhile
    assert not any(k in c.pages for k in alice), "a prefetched page of an erased tenant stayed on the host"
    for p in slots:
        assert not hp.k_buffer[p].any() and not hp.v_buffer[p].any()
    c.close()
    st.close()


def test_erasing_the_stores_deployment_tenant_erases_the_host_pages_too(tmp_path):
    from controller_pools import rows, setup

    import kvtier

    dp, hp, _, _ = setup(tmp_path / "unused", store=False)
    st = PageStore(tmp_path / "s", capacity_bytes=1 << 26, tenant="dep")
    st.register_mem_pool_host(hp)
    c = kvtier.TierController(dp, hp, st)
    keys = page_hashes(list(range(300, 300 + 3 * 4)), 4)  # the engine's keys: the store scopes them to "dep"
    c.backup(rows([1, 2, 3]), keys)
    c.wait_idle()
    starts = [c.pages[k].start // 4 for k in keys]
    assert c.erase_tenant("dep") == {"host": 3, "host_in_use": 0, "store": 3}
    assert c.match(keys) == (0, 0) and not c.pages
    for p in starts:
        assert not hp.k_buffer[p].any()
    c.close()
    st.close()


def _kvtier(*args, stdin=None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "kvtier", *map(str, args)], capture_output=True, text=True,
                          timeout=60, input=stdin)


def test_a_salt_file_that_is_no_file_of_one_line_is_refused_without_waiting(tmp_path):
    import os

    (tmp_path / "s").mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes it: opening it to read would wait for ever
    binary, endless = tmp_path / "binary", tmp_path / "endless"
    binary.write_bytes(b"\xff\xfe\x00salt\n")
    endless.write_bytes(b"a" * 10_000)
    for bad, why in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"), (tmp_path, "not a regular"),
                     (binary, "not UTF-8"), (endless, "no line end")):
        r = _kvtier("erase", tmp_path / "s", "--tenant-file", bad)
        assert r.returncode == 1 and "--tenant-file" in r.stderr and why in r.stderr, (bad, r.stderr)
    kr = Keyring.init(tmp_path / "k")
    r = _kvtier("keys", "allow", tmp_path / "k", "--tenant-file", fifo)
    assert r.returncode == 1 and "not a regular file" in r.stderr, r.stderr
    # the salt from standard input, as a pipe gives it; keys allow prints the keyed tag, never the plain one
    r = _kvtier("keys", "allow", tmp_path / "k", "--tenant-file", "-", stdin="alice\n")
    assert r.returncode == 0 and kr.stored_tag("alice") in r.stdout and tenant_tag("alice") not in r.stdout, r.stdout


def test_odd_keyring_paths_and_empty_keys_are_refused_by_name(tmp_path):
    with pytest.raises(InvalidArgumentError, match="`keyring`"):
        Keyring.init(str(tmp_path / "a\0b"))
    from kvtier.tenants import scope_keys, tenant_keys

    with pytest.raises(InvalidArgumentError, match="`keys`.*empty"):
        tenant_keys("alice", ["k1", ""])
    with pytest.raises(InvalidArgumentError, match="`keys`.*empty"):
        scope_keys("alice", [""])
    assert not any(tmp_path.iterdir())
