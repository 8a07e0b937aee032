"""PageStore: zero-copy page round trips from asymmetric host pools, durability under kill -9, corruption,
namespaces, keys that look like paths, capacity, two processes, ENOSPC, and SGLang-style page hashes."""

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import kvtier
from kvtier import DeviceKVPool, PageStore, host_pool_for, page_hashes
from store_pools import PS, make_pool, page_bytes, pages_idx

@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_asymmetric_round_trip_bit_exact(tmp_path, layout):
    hp = make_pool(layout)
    keys = [f"{i:064x}" for i in range(5)]
    want = [page_bytes(hp, p) for p in range(5)]
    with PageStore(tmp_path, capacity_bytes=1 << 30, model_name="mimo") as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(keys, pages_idx(range(5))) == [True] * 5
        assert st.batch_exists(keys) == 5 and st.exists(keys[2])
        assert st.batch_exists(keys[:2] + ["f" * 64] + keys[2:]) == 2
        hp.k_buffer.zero_()
        hp.v_buffer.zero_()
        # read back into other pages, in another order
        assert st.batch_get_v1(keys[::-1], pages_idx(range(10, 15))) == [True] * 5
        for i, p in enumerate(range(10, 15)):
            k, v = page_bytes(hp, p)
            assert torch.equal(k, want[4 - i][0]) and torch.equal(v, want[4 - i][1])
        stats = st.get_stats()
        assert stats["pages"] == 5 and stats["hits"] == 10 and stats["corrupt_reads"] == 0
        assert stats["o_direct"] in (True, False)


def test_reopen_finds_pages_and_other_geometry_misses(tmp_path):
    hp = make_pool()
    keys = ["a" * 64, "b" * 64]
    want = [page_bytes(hp, p) for p in (0, 1)]
    st = PageStore(tmp_path, model_name="m")
    st.register_mem_pool_host(hp)
    assert st.batch_set_v1(keys, pages_idx([0, 1])) == [True, True]
    st.close()
    with pytest.raises(kvtier.ClosedError):
        st.batch_exists(keys)
    for bad in ((keys, pages_idx([0, 1]).to(torch.int32)), ("k", pages_idx([0])), ([""], pages_idx([0]))):
        with pytest.raises(kvtier.ClosedError):  # the store's state first, as every store call checks it
            st.batch_get_v1(*bad)
        with pytest.raises(kvtier.ClosedError):
            st.batch_set_v1(*bad)
    hp2 = make_pool(seed=1)  # a restarted server: same geometry, fresh memory
    st2 = PageStore(tmp_path, model_name="m")
    st2.register_mem_pool_host(hp2)
    assert st2.batch_get_v1(keys, pages_idx([3, 4])) == [True, True]
    assert torch.equal(page_bytes(hp2, 3)[0], want[0][0]) and torch.equal(page_bytes(hp2, 4)[1], want[1][1])
    st2.close()
    for other in (make_pool(dv=64), make_pool(layout="page_first"), make_pool(dtype=torch.float16)):
        st3 = PageStore(tmp_path, model_name="m")
        st3.register_mem_pool_host(other)
        assert st3.batch_exists(keys) == 0 and st3.batch_get_v1(keys, pages_idx([0, 1])) == [False, False]
        st3.close()
    st4 = PageStore(tmp_path, model_name="m", tp_rank=1, tp_size=2)
    st4.register_mem_pool_host(make_pool())
    assert st4.batch_exists(keys) == 0
    st4.close()


def test_second_writer_is_refused_and_layouts_checked(tmp_path):
    hp = make_pool()
    a = PageStore(tmp_path)
    a.register_mem_pool_host(hp)
    b = PageStore(tmp_path)
    with pytest.raises(OSError, match="already open"):
        b.register_mem_pool_host(hp)
    a.close()
    sym = host_pool_for(DeviceKVPool(16, PS, 2, 1, 8, None, torch.float32, "cpu"), layout="layer_first")
    with pytest.raises(ValueError, match="supported layouts: 'page_first', 'page_first_direct'"):
        PageStore(tmp_path).register_mem_pool_host(sym)


def test_bad_arguments(tmp_path):
    hp = make_pool()
    with PageStore(tmp_path) as st:
        with pytest.raises(kvtier.KvtierError, match="register_mem_pool_host"):
            st.batch_exists(["x"])
        st.register_mem_pool_host(hp)
        with pytest.raises(ValueError, match="host_indices"):
            st.batch_set_v1(["a"], pages_idx([0, 1]))
        with pytest.raises(ValueError, match="does not start a page"):
            st.batch_set_v1(["a"], torch.arange(1, 1 + PS))
        with pytest.raises(ValueError, match="out of range"):
            st.batch_set_v1(["a"], pages_idx([hp.page_num]))
        with pytest.raises(ValueError, match="keys"):
            st.batch_set_v1("abc", pages_idx([0]))
        with pytest.raises(ValueError, match="keys"):
            st.batch_set_v1([""], pages_idx([0]))
        # a control character could frame a journal record inside the key: refused, nothing stored
        for bad in ("a\x01b", "tab\there", "nul\x00", "del\x7f"):
            with pytest.raises(ValueError, match="keys.*control characters"):
                st.batch_set_v1(["fine", bad], pages_idx([0, 1]))
            assert st.batch_get_v1([bad], pages_idx([0])) == [False]  # reads take any key: a miss
        assert st.batch_exists(["fine"]) == 0
    for kw in ({"capacity_bytes": 10}, {"io_threads": 0}, {"tp_rank": 2, "tp_size": 2}):
        with pytest.raises(ValueError):
            PageStore(tmp_path, **kw)


def test_path_like_keys_stay_inside(tmp_path):
    hp = make_pool()
    root = tmp_path / "store"
    keys = ["../../etc/evil", "/abs/olute", "a/../../b", "..", "x" * 1000]
    with PageStore(root) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(keys, pages_idx(range(5))) == [True] * 5
        assert st.batch_exists(keys) == 5
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        for name in dirnames + filenames:
            assert "evil" not in name and "abs" not in name
        assert os.path.realpath(dirpath).startswith(os.path.realpath(tmp_path))
    assert not (tmp_path / "etc").exists()
    (ns_dir,) = [p for p in root.iterdir() if p.name.startswith("ns-")]  # (beside the root's FORMAT and BUDGET)
    assert os.stat(ns_dir).st_mode & 0o777 == 0o700
    assert {p.name: os.stat(p).st_mode & 0o777 for p in root.iterdir() if p.is_file()} == {"FORMAT": 0o600,
                                                                                           "BUDGET": 0o600}


def test_capacity_evicts_least_recently_used(tmp_path):
    hp = make_pool()
    page = sum(-(-len(b) // 4096) * 4096 for b in page_bytes(hp, 0))  # K + V slots (4096-byte multiples)
    # three pages plus the journal (its records and prepaid deletes fit 8 KiB): capacity counts both
    with PageStore(tmp_path, capacity_bytes=3 * page + 8192) as st:
        st.register_mem_pool_host(hp)
        keys = [f"p{i}" for i in range(4)]
        assert st.batch_set_v1(keys[:3], pages_idx([0, 1, 2])) == [True] * 3
        assert st.batch_get_v1(keys[:1], pages_idx([5])) == [True]  # p0 is now most recent
        assert st.batch_set_v1(keys[3:], pages_idx([3])) == [True]
        assert [st.exists(k) for k in keys] == [True, False, True, True]
        s = st.get_stats()
        assert s["evictions"] == 2 and s["bytes_used"] <= 3 * page


def _data_files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".dat")]


def test_corruption_and_truncation_are_counted_misses(tmp_path):
    hp = make_pool()
    keys = ["c0", "c1", "c2"]
    with PageStore(tmp_path) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(keys, pages_idx([0, 1, 2])) == [True] * 3
        files = sorted(_data_files(tmp_path), key=os.path.getsize)
        # flip a byte in slot 0 of one data file (page c0's K or V), and truncate the other file to 1 slot
        with open(files[0], "r+b") as f:
            f.seek(123)
            b = f.read(1)
            f.seek(123)
            f.write(bytes([b[0] ^ 0xFF]))
        slot = os.path.basename(files[1]).split("-")[1].split(".")[0]
        os.truncate(files[1], int(slot))
        ok = st.batch_get_v1(keys, pages_idx([5, 6, 7]))
        assert ok[0] is False and ok[1] is False and ok[2] is False
        s = st.get_stats()
        assert s["corrupt_reads"] >= 1
        assert s["corrupt_reads"] + s["read_failures"] >= 3
        assert st.batch_exists(keys) == 0 or not st.exists("c0")


CHILD = textwrap.dedent(
    """
    import sys, torch, kvtier
    from kvtier import DeviceKVPool, PageStore, host_pool_for
    root, seed = sys.argv[1], int(sys.argv[2])
    dp = DeviceKVPool(64, 4, 3, 2, 192, 128, torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    st = PageStore(root, capacity_bytes=1 << 30)
    st.register_mem_pool_host(hp)
    i = 0
    while True:
        page = i % 16
        # page content is a pure function of the key
        g = torch.Generator().manual_seed(seed * 100000 + i)
        for t in (hp.k_buffer[page], hp.v_buffer[page]):
            u = t.view(torch.uint8)
            u.copy_(torch.randint(0, 256, u.shape, generator=g, dtype=torch.uint8))
        key = f"{seed}-{i}"
        ok = st.batch_set_v1([key], torch.arange(page * 4, page * 4 + 4))
        if ok == [True]:
            print(key, flush=True)
        i += 1
    """
)


def expected_page(key, hp, page):
    seed, i = (int(x) for x in key.split("-"))
    g = torch.Generator().manual_seed(seed * 100000 + i)
    out = []
    for t in (hp.k_buffer[page], hp.v_buffer[page]):
        u = t.view(torch.uint8)
        out.append(torch.randint(0, 256, u.shape, generator=g, dtype=torch.uint8))
    return out


@pytest.mark.timeout(240)
def test_kill_9_never_loses_acknowledged_pages(tmp_path):
    rng = random.Random(1234)
    acked = []
    for it in range(6):
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(it)], stdout=subprocess.PIPE, text=True)
        deadline = time.time() + 3 + rng.random() * 2
        got = []
        while time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            got.append(line.strip())
            if len(got) > 5 and rng.random() < 0.02:
                break
        p.send_signal(signal.SIGKILL)
        rest = p.communicate()[0]  # acknowledgements printed before the kill count too
        got += [x for x in rest.split() if x]
        acked += got
        assert got, f"iteration {it}: the child acknowledged nothing"
    dp = DeviceKVPool(64, 4, 3, 2, 192, 128, torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        r = st.verify()
        assert r["corrupt"] == [] and r["unreadable"] == [], "a torn or corrupt object survived recovery"
        assert r["checked"] >= 2 * len(acked)
        for key in acked:
            assert st.batch_get_v1([key], torch.arange(0, 4)) == [True], f"acknowledged page {key} lost"
            k, v = expected_page(key, hp, 0)
            assert torch.equal(hp.k_buffer[0].view(torch.uint8), k) and torch.equal(hp.v_buffer[0].view(torch.uint8), v)


TWO_PROC = textwrap.dedent(
    """
    import sys, torch
    from kvtier import DeviceKVPool, PageStore, host_pool_for
    root, rank = sys.argv[1], int(sys.argv[2])
    dp = DeviceKVPool(64, 4, 2, 1, 64, 32, torch.float16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    for t in (hp.k_buffer, hp.v_buffer):
        t.view(torch.uint8).fill_(rank + 1)
    st = PageStore(root, tp_rank=rank, tp_size=2, capacity_bytes=1 << 28)
    st.register_mem_pool_host(hp)
    for i in range(50):
        assert st.batch_set_v1([f"k{i}"], torch.arange(4 * (i % 16), 4 * (i % 16) + 4)) == [True]
    hp.k_buffer.zero_(); hp.v_buffer.zero_()
    for i in range(50):
        assert st.batch_get_v1([f"k{i}"], torch.arange(0, 4)) == [True]
        assert bool((hp.k_buffer[0].view(torch.uint8) == rank + 1).all())
    print("ok", rank)
    """
)


def test_two_processes_share_a_directory(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", TWO_PROC, str(tmp_path), str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert sorted(o.strip() for o, _ in outs) == ["ok 0", "ok 1"]


def test_enospc_fails_only_new_pages(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {r.stderr.strip()}")
    try:
        hp = make_pool(pages=64, layers=4, heads=4)  # pages of 24 KiB (K) + 16 KiB (V)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            st = PageStore(mnt, capacity_bytes=1 << 30)
            st.register_mem_pool_host(hp)
        # tmpfs accepts O_DIRECT on recent kernels and refuses it on older ones: either is fine, but a
        # fallback must be announced, never silent
        assert st.get_stats()["o_direct"] or any("O_DIRECT" in str(w.message) for w in caught)
        results = []
        for i in range(0, 64, 8):
            results += st.batch_set_v1([f"e{j}" for j in range(i, i + 8)], pages_idx(range(i, i + 8)))
        assert results[0] and not all(results), "a 2 MiB file system must fill up"
        stored = [k for k, ok in zip([f"e{j}" for j in range(64)], results) if ok]
        s = st.get_stats()
        assert s["write_failures"] >= 1
        # everything acknowledged before is still there and readable
        for k in stored:
            assert st.batch_get_v1([k], pages_idx([63])) == [True]
        st.close()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def reference_hashes(tokens, page_size, prior=None):
    out, prev = [], bytes.fromhex(prior) if prior else None
    for s in range(0, len(tokens), page_size):  # a trailing partial page is hashed too (as SGLang does)
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        for t in tokens[s : s + page_size]:
            h.update(int(t).to_bytes(4, "little", signed=False))
        prev = h.digest()
        out.append(h.hexdigest())
    return out


def test_page_hashes_match_the_chained_sha256_definition():
    rng = random.Random(7)
    for _ in range(20):
        ps = rng.choice([1, 2, 16, 64])
        toks = [rng.randrange(0, 2**32) for _ in range(rng.randrange(0, 300))]
        assert page_hashes(toks, ps) == reference_hashes(toks, ps)
        if len(toks) >= ps:
            first = page_hashes(toks[:ps], ps)[0]
            assert page_hashes(toks[ps:], ps, prior_hash=first) == reference_hashes(toks, ps)[1:]
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="token_ids"):
        page_hashes([-1], 1)
