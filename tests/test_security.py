"""Security properties of the page store: owner-only files and directories whatever the umask, planted
symlinks and foreign-owned directories refused, keys that never escape the store directory, namespaces and
users that cannot read each other's pages, and no code-executing deserialisation of anything read from disk."""

import os
import pathlib
import re
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

import kvtier
from kvtier import PageStore

from store_pools import make_pool, page_bytes, pages_idx

REPO = pathlib.Path(__file__).resolve().parent.parent


def modes_under(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [""] + dirnames + filenames:
            p = os.path.join(dirpath, name)
            out[p] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def test_everything_is_owner_only_even_with_an_open_umask(tmp_path):
    root = tmp_path / "a" / "b" / "store"
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO / 'tests')!r})
        os.umask(0)
        from store_pools import make_pool, pages_idx
        from kvtier import PageStore
        hp = make_pool()
        with PageStore({str(root)!r}, direct=False) as st:
            st.register_mem_pool_host(hp)
            assert st.batch_set_v1(["k0", "k1"], pages_idx([0, 1])) == [True, True]
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    modes = modes_under(root)
    assert len(modes) >= 5  # root, the namespace directory, NAMESPACE, LOCK, journal, data
    loose = {p: oct(m) for p, m in modes.items() if m & 0o077}
    assert not loose, f"group/other bits on {loose}"
    # the directories it created above the root are owner-only too (it created a/ and a/b/)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) & 0o077 == 0


def namespace_dir(root, hp, **kw):
    st = PageStore(root, **kw)
    return pathlib.Path(root) / kvtier._native.namespace_dir(st.namespace_for(hp))


def test_a_planted_symlink_is_refused(tmp_path):
    hp = make_pool()
    root = tmp_path / "store"
    root.mkdir()
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    namespace_dir(root, hp).symlink_to(elsewhere)
    st = PageStore(root)
    with pytest.raises(kvtier.InvalidArgumentError, match="symlink"):
        st.register_mem_pool_host(hp)
    assert list(elsewhere.iterdir()) == []  # nothing was written through the link


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    hp = make_pool()
    root = tmp_path / "store"
    root.mkdir()
    d = namespace_dir(root, hp)
    d.mkdir()
    os.chown(d, 65534, 65534)
    with pytest.raises(kvtier.InvalidArgumentError, match="owned by this user"):
        PageStore(root).register_mem_pool_host(hp)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another user")
def test_another_user_cannot_read_the_pages(tmp_path):
    hp = make_pool()
    root = tmp_path / "store"
    with PageStore(root) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(["secret"], pages_idx([0])) == [True]
    os.chmod(tmp_path, 0o755)  # let the other user reach the root; the store's own modes must stop it
    os.chmod(root, 0o755)
    nsdir = namespace_dir(root, hp)
    code = textwrap.dedent(f"""
        import os
        os.setgid(65534); os.setuid(65534)
        for p in [{str(nsdir)!r}] + [os.path.join({str(nsdir)!r}, n) for n in ("NAMESPACE", "journal")]:
            try:
                open(p, "rb").read() if not os.path.isdir(p) else os.listdir(p)
                print("READ", p)
            except PermissionError:
                print("denied", p)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "READ" not in r.stdout and "denied" in r.stdout, r.stdout


KEYS = ["../../etc/passwd", "/etc/shadow", "a/../../b", "..", ".", "", "x" * 65536, "nul\0byte", "new\nline",
        "ключ-ü-🔑", "C:\\windows\\system32", "~root/.ssh/authorized_keys", "ns-0000000000000000/journal"]


def test_keys_never_escape_and_read_back_exactly(tmp_path):
    hp = make_pool(pages=16)
    root = tmp_path / "store"
    before = set(os.listdir(tmp_path))
    with PageStore(root) as st:
        st.register_mem_pool_host(hp)
        stored = []
        for i, k in enumerate(KEYS):
            try:
                ok = st.batch_set_v1([k], pages_idx([i]))
            except kvtier.InvalidArgumentError:
                continue  # refusing a key is fine; writing outside the store is not
            if ok == [True]:
                stored.append((k, i))
        # refused: the empty key, one over the length limit, and keys with control characters (a journal
        # record's kind byte is one: such a key could carry a record, docs/STORE.md)
        refused = {k for k in KEYS if k not in dict(stored)}
        assert refused == {"", "x" * 65536, "nul\0byte", "new\nline"}, refused
        want = {k: page_bytes(hp, i) for k, i in stored}
        hp.k_buffer.view(torch.uint8).zero_()
        hp.v_buffer.view(torch.uint8).zero_()
        for j, (k, _) in enumerate(stored):
            assert st.batch_get_v1([k], pages_idx([j])) == [True], repr(k)[:60]
            got = page_bytes(hp, j)
            assert torch.equal(got[0], want[k][0]) and torch.equal(got[1], want[k][1]), repr(k)[:60]
    assert set(os.listdir(tmp_path)) == before | {"store"}
    for dirpath, _, filenames in os.walk(tmp_path):
        assert os.path.realpath(dirpath).startswith(os.path.realpath(root)) or dirpath == str(tmp_path)
        for f in filenames:
            assert "passwd" not in f and "shadow" not in f and "authorized" not in f


def test_namespaces_cannot_read_each_other(tmp_path):
    root = tmp_path / "store"
    hp = make_pool(seed=1)
    with PageStore(root, model_name="model-a") as a:
        a.register_mem_pool_host(hp)
        assert a.batch_set_v1(["shared-key"], pages_idx([0])) == [True]
    others = [
        (dict(model_name="model-b"), make_pool(seed=2)),  # another model
        (dict(model_name="model-a", tp_rank=1, tp_size=2), make_pool(seed=2)),  # another rank
        (dict(model_name="model-a"), make_pool(seed=2, dtype=torch.float16)),  # another dtype
        (dict(model_name="model-a"), make_pool(seed=2, dk=128, dv=128)),  # another geometry
        (dict(model_name="model-a"), make_pool(seed=2, layout="page_first")),  # another layout
    ]
    for kw, pool in others:
        before = [page_bytes(pool, 0)[0].clone(), page_bytes(pool, 0)[1].clone()]
        with PageStore(root, **kw) as b:
            b.register_mem_pool_host(pool)
            assert b.batch_exists(["shared-key"]) == 0, kw
            assert b.batch_get_v1(["shared-key"], pages_idx([0])) == [False], kw
        after = page_bytes(pool, 0)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), f"{kw}: a miss wrote bytes"


FORBIDDEN = re.compile(r"\b(pickle|cPickle|marshal|shelve|dill|cloudpickle|joblib)\b|torch\.load\s*\(|"
                       r"allow_pickle\s*=\s*True|yaml\.load\s*\(|\beval\s*\(|\bexec\s*\(|__reduce__")


def test_no_code_executing_deserialisation_in_the_package():
    hits = []
    for base, pattern in ((REPO / "python" / "kvtier", "*.py"), (REPO / "rust", "*.rs")):
        for p in base.rglob(pattern):
            for n, line in enumerate(p.read_text().splitlines(), 1):
                code = line.split("#", 1)[0] if p.suffix == ".py" else line.split("//", 1)[0]
                if FORBIDDEN.search(code):
                    hits.append(f"{p.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "code-executing deserialisation (or eval/exec) found:\n" + "\n".join(hits)


def test_a_planted_namespace_tmp_symlink_is_replaced_not_followed(tmp_path):
    hp = make_pool()
    root = tmp_path / "store"
    root.mkdir()
    d = namespace_dir(root, hp)
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (d / "NAMESPACE.tmp").symlink_to(victim)
    with PageStore(root) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(["k"], pages_idx([0])) == [True]
    assert victim.read_bytes() == b"precious"


def test_a_namespace_file_that_is_not_ours_is_refused_not_overwritten(tmp_path):
    hp = make_pool()
    root = tmp_path / "store"
    root.mkdir()
    d = namespace_dir(root, hp)
    d.mkdir(mode=0o700)
    (d / "NAMESPACE").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(kvtier.InvalidArgumentError, match="belongs to namespace"):
        PageStore(root).register_mem_pool_host(hp)
    assert (d / "NAMESPACE").read_bytes() == b"\xff\xfe not utf-8"
