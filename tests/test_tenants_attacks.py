"""Tenants and encryption at rest under attack: an erased key whose file comes back on the same inode, a sealed
page served without its record, namespaces erase cannot open, a missing key file, a keyring directory taken
over, a damaged key file, a sealed object moved to another namespace. Each test states what docs/SECURITY.md
promises."""

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import time

import pytest
import torch

from kvtier import PageStore, page_hashes
from kvtier.tenants import Keyring, tenant_tag

from store_pools import PS, make_pool, page_bytes, pages_idx

TOKENS = list(range(3000, 3000 + 8 * PS))


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _key_file(ring_dir, salt):
    """Where tenant ``salt``'s key file lives: named by its keyed tag."""
    return ring_dir / "tenants" / f"{Keyring(ring_dir).stored_tag(salt)}.key"


def _kvtier(*args):
    return subprocess.run([sys.executable, "-m", "kvtier", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


# --- 1. an erased tenant key keeps working in a running server (inode reuse) --------------------------------


def _recreate_with_same_inode(path, ino, tries=20000):
    """Another process creates the tenant's key file again (as a node's first write after the erasure does).
    ext4 gives a new file the lowest free inode of its group: files other processes create meanwhile fill
    the holes below the freed one (here: kept as fillers), and then the key file gets the freed inode."""
    fillers = []
    try:
        for n in range(tries):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, (os.urandom(32).hex() + "\n").encode())
            os.close(fd)
            if os.stat(path).st_ino == ino:
                return True
            filler = os.path.join(os.path.dirname(path), f"filler-{n}")
            os.rename(path, filler)
            fillers.append(filler)
        return False
    finally:
        for f in fillers:
            os.remove(f)


def test_an_erased_key_stops_working_in_a_running_server_even_if_the_file_is_recreated(tmp_path):
    """SECURITY.md: 'A running server holding the key notices at its next batch'; after erasure 'whatever
    ... kept of its sealed pages can no longer be opened'. The server's key cache is keyed by the key file's
    (dev, inode) only; ext4 hands a freed inode to the next file created, so a key file recreated after the
    erasure (by a write for the tenant on another process or node) looks like the old one, and the running
    server keeps the destroyed key: it still opens the pages sealed before the erasure (and seals new ones
    with it, which nobody else can open)."""
    ring_dir = tmp_path / "keys"
    Keyring.init(ring_dir)
    hp = make_pool(seed=5)
    alice = page_hashes(TOKENS[: 4 * PS], PS, salt="alice")
    kf = str(_key_file(ring_dir, "alice"))
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=Keyring(ring_dir)) as server:
        server.register_mem_pool_host(hp)
        assert server.batch_set_v1(alice[:2], pages_idx([0, 1])) == [True, True]  # before the erasure
        ino = os.stat(kf).st_ino
        # the operator destroys alice's key (kvtier erase --keyring ... --yes: the server's namespace is live,
        # so it is 'kept and named'; the key is destroyed anyway, the server is to notice at its next batch)
        assert Keyring(ring_dir).erase("alice")
        if not _recreate_with_same_inode(kf, ino):
            pytest.skip("this file system did not reuse the inode")
        # the pages sealed before the erasure must not open any more
        got = server.batch_get_v1(alice[:2], pages_idx([8, 9]))
        assert got == [False, False], "pages sealed under the destroyed key were served after its erasure"


def test_a_writer_running_across_an_erasure_cannot_store_the_tenants_pages_again(tmp_path):
    """SECURITY.md: 'an erased tenant stays erased until an operator allows it again, in every process that
    shares the keyring'. A server still holding the tenant's pages after `kvtier erase --keyring` writes them
    back; even with a key file planted on the freed inode, nothing it writes is stored, and a fresh process
    reads nothing of the tenant."""
    ring_dir = tmp_path / "keys"
    Keyring.init(ring_dir)
    hp = make_pool(seed=6)
    alice = page_hashes(TOKENS[: 4 * PS], PS, salt="alice")
    kf = str(_key_file(ring_dir, "alice"))
    want = page_bytes(hp, 2)
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=Keyring(ring_dir)) as server:
        server.register_mem_pool_host(hp)
        assert server.batch_set_v1(alice[:1], pages_idx([0])) == [True]
        ino = os.stat(kf).st_ino
        assert Keyring(ring_dir).erase("alice")
        if not _recreate_with_same_inode(kf, ino):
            pytest.skip("this file system did not reuse the inode")
        assert server.batch_set_v1(alice[:3], pages_idx([0, 1, 2])) == [False] * 3  # refused, not stored
    hp2 = make_pool(seed=99)
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=Keyring(ring_dir)) as fresh:
        fresh.register_mem_pool_host(hp2)
        assert fresh.batch_get_v1(alice[:3], pages_idx([4, 5, 6])) == [False] * 3
        assert fresh.batch_set_v1(alice[2:3], pages_idx([2])) == [False]
    # the operator allows the tenant again: new pages are stored and open under a new key
    assert Keyring(ring_dir).allow("alice")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=Keyring(ring_dir)) as fresh:
        fresh.register_mem_pool_host(hp2)
        hp2.k_buffer[:] = hp.k_buffer
        hp2.v_buffer[:] = hp.v_buffer
        assert fresh.batch_set_v1(alice[2:3], pages_idx([2])) == [True]
        assert fresh.batch_get_v1(alice[2:3], pages_idx([5])) == [True]
        assert _same(page_bytes(hp2, 5), want)


# --- 2. erase skips namespaces it cannot read, silently, and reports success --------------------------------


def test_erase_never_reports_success_while_a_namespace_of_the_directory_still_holds_the_tenant(tmp_path):
    """SECURITY.md: 'Disk: every namespace of the directory loses the tenant's objects ... A namespace a
    running server holds is kept and named (exit 1)'. A namespace whose directory name does not match its
    NAMESPACE file (a copy or rename, e.g. an operator's backup inside the store directory) is a 'problem'
    entry of list_namespaces, and _erase_disk skips it with `continue`: nothing printed, exit 0."""
    hp = make_pool(seed=8)
    alice = page_hashes(TOKENS[: 2 * PS], PS, salt="alice")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30) as st:  # a clear store: pages in clear
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(alice, pages_idx([0, 1])))
        ns_dir = st.native_store().dir
    shutil.copytree(ns_dir, ns_dir + "-copy")  # a copy in the store directory
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--yes")
    # the tenant's key names are still in the copy's journal (and its pages in its data files)
    left = False
    for f in os.listdir(ns_dir + "-copy"):
        if os.path.isfile(os.path.join(ns_dir + "-copy", f)):
            with open(os.path.join(ns_dir + "-copy", f), "rb") as fh:
                left |= tenant_tag("alice").encode() in fh.read()
    assert left
    assert r.returncode != 0 or "copy" in r.stdout, f"exit {r.returncode}, output:\n{r.stdout}"


# --- 3. `kvtier keys init` on an existing directory changes its mode ----------------------------------------


def test_keys_init_refuses_a_directory_others_can_write_and_changes_nothing(tmp_path):
    """A keyring in a directory others can write (a shared one, like /tmp) could have its keys planted or
    swapped: `kvtier keys init` refuses it, and leaves its mode and contents as they were."""
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)  # like /tmp
    r = _kvtier("keys", "init", d)
    assert r.returncode != 0 and "writable by group or others" in r.stderr, r.stderr
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1777, oct(stat.S_IMODE(os.stat(d).st_mode))
    assert os.listdir(d) == []
    # a keyring in its own directory below it is fine (the sticky bit keeps others from replacing it)
    assert _kvtier("keys", "init", d / "keys").returncode == 0
    assert _kvtier("keys", "init", d / "keys").returncode != 0  # and is never overwritten


def test_keys_init_on_an_existing_non_empty_directory_keeps_its_mode(tmp_path):
    d = tmp_path / "home"
    d.mkdir()
    (d / "other-file").write_text("x")
    os.chmod(d, 0o755)
    r = _kvtier("keys", "init", d)
    print(r.stdout, r.stderr)
    # either refuse a non-empty directory, or leave its mode alone: silently making it 0700 is neither
    assert r.returncode != 0 or stat.S_IMODE(os.stat(d).st_mode) == 0o755, oct(stat.S_IMODE(os.stat(d).st_mode))


# --- 4. a truncated tenant key file (crash inside create_secret) -------------------------------------------


def test_a_truncated_tenant_key_file_does_not_silently_fail_every_write_forever(tmp_path):
    """create_secret creates the file (create_new) before writing it: a kill -9 in between leaves an empty
    tenants/<tag>.key. From then on tenant_key() finds the file, cannot parse it and returns None: every
    write of the tenant fails (batch_set_v1 False, no error, no log), forever, and `kvtier keys list` shows
    the tenant as having a key."""
    ring_dir = tmp_path / "keys"
    Keyring.init(ring_dir)
    (_key_file(ring_dir, "alice")).write_bytes(b"")  # the crash's leftover
    os.chmod(_key_file(ring_dir, "alice"), 0o600)
    hp = make_pool()
    alice = page_hashes(TOKENS[: 2 * PS], PS, salt="alice")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=Keyring(ring_dir)) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(alice, pages_idx([0, 1])) == [True, True]


def test_a_key_file_missing_for_a_moment_does_not_delete_the_tenants_pages(tmp_path):
    """A tenant key file that is not there *for now* (a keyring on a shared file system with a hiccup, keys
    being re-provisioned by a tool that replaces files, SECURITY.md's 'the same files distributed to each
    node' not done yet) maps to 'no key': every read of the tenant is CORRUPT, and the store then deletes the
    objects durably. A transient keyring problem loses the tenant's whole disk cache (and counts it as
    corruption). Only an erased key should make pages unreadable for good."""
    ring_dir = tmp_path / "keys"
    Keyring.init(ring_dir)
    hp = make_pool(seed=4)
    alice = page_hashes(TOKENS[: 2 * PS], PS, salt="alice")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=Keyring(ring_dir)) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(alice, pages_idx([0, 1])))
    kf = _key_file(ring_dir, "alice")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=Keyring(ring_dir)) as st:
        st.register_mem_pool_host(hp)
        os.rename(kf, str(kf) + ".away")
        try:
            assert st.batch_get_v1(alice, pages_idx([4, 5])) == [False, False]  # a miss is right
        finally:
            os.rename(str(kf) + ".away", kf)
        assert st.batch_exists(alice) == 2, "the pages were deleted because the key file was missing a moment"


# --- 5. the cluster tier serves ciphertext as KV with accept_unverified --------------------------------------


@pytest.mark.timeout(240)
def test_sealed_cluster_tier_never_serves_ciphertext_without_a_record(cluster, tmp_path):
    """SECURITY.md: 'a wrong key, a flipped byte, a swapped object or an erased tenant is a counted miss, never
    served'. A page whose record is gone (evicted, removed, a put that stored the data but not the record)
    must not be served on its size alone: a sealed tier refuses accept_unverified, and misses such a page."""
    from kvtier import InvalidArgumentError
    from kvtier.tiers.mooncake import MooncakeTier

    kr = Keyring.init(tmp_path / "keys")
    with pytest.raises(InvalidArgumentError, match="accept_unverified"):
        MooncakeTier(cluster.master_address, model_name="m", keyring=kr, accept_unverified=True)
    src, dst = make_pool(seed=31), make_pool(seed=32)
    keys = page_hashes(TOKENS[: 2 * PS], PS, salt="alice")
    with MooncakeTier(cluster.master_address, model_name="m", keyring=kr) as t:
        t.register_mem_pool_host(src)
        assert t.batch_set_v1(keys, pages_idx([0, 1])) == [True, True]
        time.sleep(0.5)
        for rec in t._records(t._stored(keys), create=False):
            assert t._store.remove(rec) == 0
    with MooncakeTier(cluster.master_address, model_name="m", keyring=kr) as t:
        t.register_mem_pool_host(dst)
        assert t.batch_get_v1(keys, pages_idx([4, 5])) == [False, False]


@pytest.mark.timeout(240)
def test_sealed_cluster_put_with_one_bad_tenant_key_fails_only_that_tenants_pages(cluster, tmp_path):
    """batch_set_v1 returns per-page results: a tenant whose key cannot be made (here: its key file's name is
    taken by a directory) fails its own pages, and the other tenants' pages of the batch are stored. A key
    file left empty or damaged is replaced at the tenant's next write (its old pages become misses)."""
    from kvtier.tiers.mooncake import MooncakeTier

    kr = Keyring.init(tmp_path / "keys")
    _key_file(tmp_path / "keys", "alice").mkdir()
    empty = _key_file(tmp_path / "keys", "carol")
    empty.write_bytes(b"")
    os.chmod(empty, 0o600)
    src, dst = make_pool(seed=33), make_pool(seed=34)
    alice = page_hashes(TOKENS[: PS], PS, salt="alice")
    bob = page_hashes(TOKENS[: PS], PS, salt="bob")
    carol = page_hashes(TOKENS[: PS], PS, salt="carol")
    with MooncakeTier(cluster.master_address, model_name="m2", keyring=kr) as t:
        t.register_mem_pool_host(src)
        assert t.batch_set_v1(bob + alice + carol, pages_idx([0, 1, 2])) == [True, False, True]
    with MooncakeTier(cluster.master_address, model_name="m2", keyring=kr) as r:
        r.register_mem_pool_host(dst)
        assert r.batch_get_v1(bob + carol, pages_idx([4, 6])) == [True, True]
        assert _same(page_bytes(dst, 4), page_bytes(src, 0)) and _same(page_bytes(dst, 6), page_bytes(src, 2))


# --- 6. a sealed object moved to another namespace of the same keyring is served -----------------------------


def test_a_sealed_object_moved_to_another_namespace_is_not_served(tmp_path):
    """The AAD is the object's key only, not its namespace: with one keyring, the same key in a namespace of
    another model (or dtype, tp rank...) opens. Someone who can write the store directory can make model B
    serve model A's KV (SECURITY.md: 'a swapped object ... never served')."""
    kr = Keyring.init(tmp_path / "keys")
    hp = make_pool(seed=12)
    keys = page_hashes(TOKENS[: 2 * PS], PS, salt="alice")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=kr, model_name="model-a") as a:
        a.register_mem_pool_host(hp)
        assert all(a.batch_set_v1(keys, pages_idx([0, 1])))
        dir_a = a.native_store().dir
    hp_b = make_pool(seed=13)
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=kr, model_name="model-b") as b:
        b.register_mem_pool_host(hp_b)
        assert b.batch_exists(keys) == 0
        dir_b = b.native_store().dir
    for f in os.listdir(dir_a):
        if f != "NAMESPACE" and os.path.isfile(os.path.join(dir_a, f)):
            shutil.copy2(os.path.join(dir_a, f), os.path.join(dir_b, f))
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=kr, model_name="model-b") as b:
        b.register_mem_pool_host(hp_b)
        got = b.batch_get_v1(keys, pages_idx([4, 5]))
        assert got == [False, False], "model-a's sealed pages were served by model-b's namespace"


# --- 7. erase dry-run changes nothing ------------------------------------------------------------------------


def _tree_digest(root):
    h = hashlib.sha256()
    for d, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(d, f)
            st = os.stat(p)
            h.update(p.encode() + str((st.st_size, st.st_mode, st.st_mtime_ns)).encode())
            with open(p, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def test_erase_dry_run_changes_nothing(tmp_path):
    Keyring.init(tmp_path / "keys")
    hp = make_pool()
    alice = page_hashes(TOKENS[: 2 * PS], PS, salt="alice")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=Keyring(tmp_path / "keys")) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(alice, pages_idx([0, 1])))
    before = _tree_digest(tmp_path)
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--keyring", tmp_path / "keys")
    assert r.returncode == 0 and "nothing erased" in r.stdout, r.stdout + r.stderr
    assert _tree_digest(tmp_path) == before


def test_a_key_shaped_like_another_tenants_never_escapes_a_deployment_tenant(tmp_path):
    """A caller of a deployment scoped to tenant acme hands in a key that already looks scoped, `t<bob's tag>.…`
    (bob's real page key, learnt or guessed): it is scoped again inside acme, so it never reaches bob's page."""
    hp = make_pool(seed=12)
    plain = page_hashes(TOKENS[: 2 * PS], PS)
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, tenant="bob") as bob:
        bob.register_mem_pool_host(hp)
        assert all(bob.batch_set_v1(plain, pages_idx([0, 1])))
    bobs_keys = page_hashes(TOKENS[: 2 * PS], PS, salt="bob")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, tenant="acme") as acme:
        acme.register_mem_pool_host(hp)
        assert acme.batch_exists(bobs_keys) == 0
        assert acme.batch_get_v1(bobs_keys, pages_idx([4, 5])) == [False, False]
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30) as unscoped:
        unscoped.register_mem_pool_host(hp)
        assert unscoped.batch_exists(bobs_keys) == 2  # they are bob's keys: only a deployment scope stops them
