"""`kvtier replay` (also `kvtier bench replay`): a request trace through kvtier's host pool and PageStore against
the LRU model of the same tiers — on a sample trace, on hand-built traces whose hit rates are worked out below,
across nodes (separate stores against one shared), and with bad input. tests/data/replay_sample.jsonl is what
:func:`sample_trace_lines` writes (multi-turn conversations over a few shared system prompts; made here, not
taken from the Mooncake traces)."""

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier

from kvtier._errors import KvtierError
from kvtier.replay import command as replay
from kvtier.replay import trace as tr
from kvtier.replay.model import LruTier, ModelNode, one_lru_pct
from kvtier.replay.report import disagreements
from kvtier.replay.runner import Setup, run
from kvtier.replay.tiers import RECORD_FIXED, disk_page_bytes, store_capacity_bytes

pytestmark = pytest.mark.timeout(120)
SAMPLE = os.path.join(os.path.dirname(__file__), "data", "replay_sample.jsonl")


def sample_trace_lines(seed=7, conversations=60, prompts=4):
    """A trace in the Mooncake format: conversations of 1-8 turns, each over one of ``prompts`` shared system
    prompts (1-4 blocks); a turn adds 1-4 blocks to its conversation; turns of conversations interleave."""
    rng = random.Random(seed)
    next_id = iter(range(10**9))
    system = [[next(next_id) for _ in range(rng.randint(1, 4))] for _ in range(prompts)]
    convs = [{"ids": list(rng.choice(system)), "turns": rng.randint(1, 8)} for _ in range(conversations)]
    lines, t = [], 0
    while any(c["turns"] for c in convs):
        c = rng.choice([c for c in convs if c["turns"]])
        c["turns"] -= 1
        c["ids"] += [next(next_id) for _ in range(rng.randint(1, 4))]
        length = 512 * len(c["ids"]) - rng.randint(0, 511)
        t += rng.randint(0, 3000)
        lines.append(
            json.dumps(
                {"timestamp": t, "input_length": length, "output_length": rng.randint(1, 500), "hash_ids": c["ids"]}
            )
            + "\n"
        )
    return lines


def setup(tmp_path, host_pages, page_bytes=16384):
    return Setup(
        host_pages=host_pages,
        page_bytes=page_bytes,
        bytes_per_token=327680,
        prefill_tokens_per_s=7200.0,
        root=str(tmp_path),
        key_len=4,
        batch_pages=64,
    )


def reqs(rows):
    return [tr.Request(i, length, 1, tuple(ids)) for i, (length, ids) in enumerate(rows)]


def kv(cmd, *args, cwd=None):
    """The CLI in a child process, importing this kvtier whatever the working directory."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(kvtier.__file__))))
    return subprocess.run(
        [sys.executable, "-m", "kvtier", *cmd.split(), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=100,
    )


def test_sample_trace_is_what_the_generator_writes():
    with open(SAMPLE) as f:
        assert f.read() == "".join(sample_trace_lines())
    assert len(tr.load(SAMPLE).requests) == 264


def test_sample_trace_replays_and_kvtier_agrees_with_the_model(tmp_path):
    r = kv(
        "replay --trace",
        SAMPLE,
        "--capacities",
        "25K,100K,inf",
        "--host-tokens",
        "16K",
        "--out",
        str(tmp_path / "out"),
        "--plot",
        str(tmp_path / "hit.png"),
        "--dir",
        str(tmp_path / "stores"),
    )
    assert r.returncode == 0, r.stderr
    assert "kvtier agrees with the LRU model within 1.0 point(s) on every row" in r.stdout
    run_ = json.loads((tmp_path / "out" / "cpu-replay.json").read_text())["replay_sample.jsonl sweep"]
    rows = run_["rows"]
    assert [row["capacity"] for row in rows] == ["25K", "100K", "inf"]
    for row in rows:
        for what in ("hit_pct", "host_pct", "store_pct"):
            assert abs(row["kvtier"][what] - row["model"][what]) <= 1.0, (row["capacity"], what)
        assert row["moved"]["disk_written_bytes"] > 0
        assert row["moved_scaled"]["disk_written_bytes"] == row["moved"]["disk_written_bytes"] * 327680 * 512 // 16384
    # more store, more hits; unlimited (with a host tier larger than any request) reaches the best possible
    assert rows[0]["kvtier"]["hit_pct"] < rows[1]["kvtier"]["hit_pct"] < rows[2]["kvtier"]["hit_pct"]
    assert rows[2]["model"]["hit_pct"] == pytest.approx(run_["best_pct"])
    assert (tmp_path / "hit.png").stat().st_size > 0
    assert not (tmp_path / "stores").exists() or not os.listdir(tmp_path / "stores")  # every run's stores removed


# A hand-built trace, host of 4 blocks, store unlimited. Host order after each request (oldest first):
# r1 [1,2,3] misses: host 1 2 3, store 1 2 3
# r2 [1,2,4] (1500 tokens): host run 1,2 (1024 tokens); 4 misses: host 3 1 2 4, store + 4
# r3 [5,6,7] misses: 3, 1, 2 evicted: host 4 5 6 7, store + 5 6 7
# r4 [1,2,3,8] (2000 tokens): nothing on the host; store run 1,2,3 (1536 tokens) read back, evicting 4 5 6;
#    8 misses, evicting 7: host 1 2 3 8
# r5 [5,6]: store run 5,6 (1024 tokens) read back, evicting 1, 2: host 3 8 5 6
HAND = [(1536, [1, 2, 3]), (1500, [1, 2, 4]), (1536, [5, 6, 7]), (2000, [1, 2, 3, 8]), (1024, [5, 6])]
HAND_TOTAL = 1536 + 1500 + 1536 + 2000 + 1024


def test_hand_built_trace_hits_what_was_worked_out(tmp_path):
    row = run(
        reqs(HAND), setup(tmp_path, 4), nodes=1, store_pages=None, shared=False, routing="prefix", seed=0, label="hand"
    )
    for side in ("kvtier", "model"):
        assert row[side]["host_pct"] == pytest.approx(100 * 1024 / HAND_TOTAL), side
        assert row[side]["store_pct"] == pytest.approx(100 * (1536 + 1024) / HAND_TOTAL), side
        assert row[side]["host_evictions"] == 3 + 4 + 2, side
    assert row["requests_differing"] == 0
    assert row["moved"]["disk_read_bytes"] == 5 * 16384  # 1,2,3 then 5,6 read back
    assert row["moved"]["disk_written_bytes"] == 8 * 16384  # each block once


def test_model_store_evicts_its_least_recently_used_page_never_one_being_written():
    store = LruTier(3)
    store.write([1, 2, 3])
    store.read([1])  # order 2 3 1
    assert store.write([4]) == [4] and list(store.pages) == [3, 1, 4]
    assert store.write([3, 5]) == [3, 5] and list(store.pages) == [4, 3, 5]  # 3 touched first, then 1 evicted
    # one LRU cache: [1,2] then [1,2] with room for one block: the prefix's first block was evicted
    assert one_lru_pct([(1024, [1, 2]), (1024, [1, 2])], 1) == 0.0
    assert one_lru_pct([(1024, [1, 2]), (1024, [1, 2])], 2) == 50.0


def test_model_host_pins_a_requests_own_pages_and_backs_up_what_fits():
    node = ModelNode(2, LruTier(None))
    assert node.serve([1, 2, 3]) == (0, 0)  # three new blocks, room for two: 1 and 2 kept and written
    assert list(node.host) == [1, 2] and list(node.store.pages) == [1, 2]
    assert node.serve([1, 2, 3]) == (2, 0)  # the host run pins 1, 2: block 3 finds no room again


def test_two_nodes_shared_store_against_separate(tmp_path):
    """[1,2] four times over two nodes, random routing: shared, only the first request misses (75%); separate,
    the first request on each node misses."""
    trace = reqs([(1024, [1, 2])] * 4)
    seed = 3
    draws = random.Random(seed)
    routes = [draws.randrange(2) for _ in range(4)]
    assert len(set(routes)) == 2  # the seed sends requests to both nodes
    kw = dict(nodes=2, routing="random", seed=seed)
    sep = run(trace, setup(tmp_path, 4), store_pages=None, shared=False, label="sep", **kw)
    shr = run(trace, setup(tmp_path, 4), store_pages=None, shared=True, label="shr", **kw)
    for side in ("kvtier", "model"):
        assert sep[side]["hit_pct"] == pytest.approx(50.0), side
        assert shr[side]["hit_pct"] == pytest.approx(75.0), side
        assert shr[side]["hit_pct"] / sep[side]["hit_pct"] == pytest.approx(1.5)
    assert sep["served_per_node"] == [routes.count(0), routes.count(1)]
    assert shr["kvtier"]["store_pct"] > 0  # the second node found the first node's blocks in the shared store


def test_prefix_routing_sends_a_request_where_most_of_its_prefix_is(tmp_path):
    """Every request starts with block 0 (as the conversation trace's do). r1 [0,1,2]: nothing cached, node 0
    (least served); r2 [0,3,4]: node 0 holds a third, under half: node 1 (least served); r3 [0,1,2,5]: node 0
    holds 3 of 4 (1536 tokens hit); r4 [0,9,10]: each node holds a third: node 1, least served (512 hit);
    r5 [0,3,5]: node 1 holds 2 of 3 (1024 hit)."""
    trace = reqs([(1536, [0, 1, 2]), (1536, [0, 3, 4]), (2048, [0, 1, 2, 5]), (1536, [0, 9, 10]), (1536, [0, 3, 5])])
    row = run(trace, setup(tmp_path, 8), nodes=2, store_pages=None, shared=False, routing="prefix", seed=0, label="p")
    assert row["served_per_node"] == [2, 3]
    hit = 100 * (1536 + 512 + 1024) / (4 * 1536 + 2048)
    assert row["kvtier"]["hit_pct"] == pytest.approx(hit) and row["model"]["hit_pct"] == pytest.approx(hit)


def test_store_capacity_holds_the_pages_and_its_journal():
    assert disk_page_bytes(16384) == 16384 and disk_page_bytes(8192) == 8192
    for pages in (100, 5859, 97656):
        cap = store_capacity_bytes(pages, 16384, 5)
        assert pages * 16384 < cap < pages * 16384 * 1.06, pages
    assert store_capacity_bytes(None, 16384, 5) >= 1 << 50


def test_record_fixed_is_the_clear_put_record_of_the_store_layout():
    # docs/STORE.md's layout table is made from the core's record layout (a Rust test holds it to it)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "STORE.md").read_text()
    want = f"A del or a clear put is `{RECORD_FIXED} + key_len` bytes"
    assert want in doc, "RECORD_FIXED differs from docs/STORE.md's clear put record"


def test_disagreements_name_the_row_and_the_share():
    row = {
        "label": "3M",
        "kvtier": {"hit_pct": 20.0, "host_pct": 5.0, "store_pct": 15.0},
        "model": {"hit_pct": 21.5, "host_pct": 5.0, "store_pct": 16.5},
    }
    bad = disagreements([row], 1.0)
    assert len(bad) == 2 and "3M: kvtier hit_pct 20.00 vs model 21.50" in bad[0] and "store_pct" in bad[1]
    assert disagreements([row], 2.0) == []


def test_gzip_trace_and_token_counts(tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(Path(SAMPLE).read_bytes()))
    assert tr.load(str(gz)).requests == tr.load(SAMPLE).requests
    assert tr.load(SAMPLE, limit=5).requests == tr.load(SAMPLE).requests[:5]
    assert tr.parse_tokens("x", "3M") == 3e6 and tr.parse_tokens("x", "1.5k") == 1500 and tr.parse_tokens("x", "inf")
    assert tr.blocks_of(3e6) == 5859 and tr.blocks_of(float("inf")) is None


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n{"timestamp": 1,',
            "t.jsonl:2: not valid JSON",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n',
            "1 hash_ids for input_length 600",
        ),
        ('{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": ["a"]}\n', "`hash_ids` must be a list"),
        (
            '{"timestamp": -1, "input_length": 6, "output_length": 1, "hash_ids": [1]}\n',
            "`timestamp` must be an integer",
        ),
        ("[1, 2]\n", "t.jsonl:1: expected a JSON object"),
        ("\n\n", "no requests in the trace"),
    ],
)
def test_bad_trace_lines_are_named_with_their_line_number(tmp_path, text, message):
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    with pytest.raises(KvtierError, match=message):
        tr.load(str(p))


@pytest.mark.parametrize(
    "args, message",
    [
        (("--capacities", "3M,lots"), "--capacities: 'lots' is not a token count"),
        (("--capacities", "100"), "less than one 512-token block"),
        (("--page-bytes", "4K"), "--page-bytes 4K: must be a multiple of 8K"),
        (("--host-tokens", "inf"), "--host-tokens inf: give a finite size"),
        (("--nodes", "0"), "--nodes must be in \\[1, 64\\]"),
        (("--limit", "0"), "--limit must be at least 1"),
        (("--read-gbps", "disk=fast"), "--read-gbps: 'disk=fast' is not TIER=GBPS"),
        (("--cluster", "--capacities", "500K", "--page-bytes", "8K"), "under the 16 MiB Mooncake mounts"),
        (("--read-gbps", "nvme=3"), "the tier is disk or mooncake"),
        (("--plot", "x.bogus"), "--plot x.bogus: give a file name ending in one of"),
    ],
)
def test_bad_arguments_are_refused_before_any_replay(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KvtierError, match=message):
        replay.main(["--trace", SAMPLE, *args])
    assert os.listdir(tmp_path) == []  # no store directory left behind


def test_a_bad_trace_is_a_one_line_error_from_the_command(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n{"timestamp"\n')
    for path, message in ((tmp_path / "missing.jsonl", "no such file"), (bad, "bad.jsonl:2: not valid JSON")):
        r = kv("bench replay --trace", str(path), cwd=tmp_path)
        assert r.returncode == 1 and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_named_trace_is_found_by_name_and_checked_by_sha256(tmp_path, monkeypatch):
    monkeypatch.setattr(tr, "trace_dirs", lambda: [tmp_path])
    monkeypatch.setenv("KVTIER_TRACE_OFFLINE", "1")  # (tests/test_replay_fetch.py: the download)
    with pytest.raises(KvtierError, match="conversation_trace.jsonl\\[.gz\\] is not in any of"):
        tr.resolve("conversation")
    (tmp_path / "synthetic_trace.jsonl.gz").write_bytes(gzip.compress(Path(SAMPLE).read_bytes()))
    with pytest.raises(KvtierError, match="is not the synthetic trace's bd070915"):
        tr.load("synthetic")
