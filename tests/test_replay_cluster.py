"""`kvtier replay --cluster`: the sample trace through a host tier and the Mooncake cluster tier (a
LocalCluster on 127.0.0.1) against the model of Mooncake's eviction; several nodes sharing one cluster tier;
and the cluster torn down when the replay raises or is interrupted."""

import json
import os
import random
import socket

import pytest

from kvtier.replay import cluster as replay_cluster
from kvtier.replay import tiers as replay_tiers
from kvtier.replay import trace as tr
from kvtier.replay.cluster import ClusterRun, cluster_memory
from kvtier.replay.model import ClusterLru, LruTier, ModelNode
from kvtier.replay.runner import run
from test_replay import SAMPLE, kv, setup

pytestmark = pytest.mark.timeout(300)  # a hang guard, not a timing judged


def test_sample_trace_through_the_cluster_tier_agrees_with_the_model(tmp_path):
    r = kv(
        "replay --trace",
        SAMPLE,
        "--cluster",
        "--capacities",
        "300K",
        "--host-tokens",
        "16K",
        "--page-bytes",
        "32K",
        "--out",
        str(tmp_path / "out"),
        "--dir",
        str(tmp_path / "stores"),
    )
    assert r.returncode == 0, r.stderr
    assert "kvtier agrees with the LRU model within 1.0 point(s) on every row" in r.stdout
    row = json.loads((tmp_path / "out" / "cpu-replay.json").read_text())["replay_sample.jsonl sweep, cluster"]["rows"][0]
    assert row["store_tier"] == "mooncake" and row["cluster_memory_bytes"] == 19 << 20
    assert row["kvtier"]["store_pct"] > 20 and abs(row["kvtier"]["store_pct"] - row["model"]["store_pct"]) <= 1
    assert row["moved"]["mooncake_read_bytes"] > 0 and row["moved"]["mooncake_written_bytes"] > 0
    # the capacity was reached: Mooncake evicted, by its watermark rule, about what the model did (give or take
    # one round, 5-15% of the pages held: the eviction thread's rounds fall inside or after a put)
    assert row["model"]["store_evictions"] > 0 and row["kvtier"]["store_evictions"] > 0
    one_round = 0.15 * row["store_pages"]
    assert abs(row["kvtier"]["store_evictions"] - row["model"]["store_evictions"]) <= one_round
    assert "store_read_GBps" in row["ttft"] and row["ttft"]["store_source"] == "measured"  # (measured; its value is a bench's)


def test_three_nodes_share_one_cluster_tier(tmp_path):
    """Random routing over three nodes: with one cluster tier a node finds what the others wrote, so the shared
    tier hits more than three separate PageStores of a third of its pages; kvtier agrees with the model."""
    reqs = tr.load(SAMPLE).requests
    pages = 200
    shr = run(reqs, setup(tmp_path, 31, page_bytes=32768), nodes=3, store_pages=None, shared=True, routing="random",
              seed=1, label="shr", cluster_memory=cluster_memory(3 * pages, 32768, 0))
    # separate stores, in the model (kvtier's separate PageStores agree with it: tests/test_replay.py), with the
    # same random draw the replay makes
    draw, nodes = random.Random(1), [ModelNode(31, LruTier(pages)) for _ in range(3)]
    hit = 0
    for r in reqs:
        n, m = nodes[draw.randrange(3)].serve(r.hash_ids)
        hit += min((n + m) * 512, r.input_length)
    separate_pct = 100 * hit / sum(r.input_length for r in reqs)
    assert shr["store_tier"] == "mooncake" and shr["nodes"] == 3 and sum(shr["served_per_node"]) == len(reqs)
    assert min(shr["served_per_node"]) > 50
    for what in ("hit_pct", "host_pct", "store_pct"):
        assert abs(shr["kvtier"][what] - shr["model"][what]) <= 1.0, what
    assert shr["kvtier"]["hit_pct"] > separate_pct + 10
    assert shr["kvtier"]["store_pct"] > 2 * shr["kvtier"]["host_pct"]  # most hits came through the cluster


def test_model_cluster_touches_what_a_query_finds_and_evicts_by_the_watermark():
    c = ClusterLru(memory=100, page_cost=10, high_watermark=0.9, ratio=0.05)
    c.write(list(range(9)))  # 90%: at the watermark, not over it
    assert c.evictions == 0 and len(c.pages) == 9
    assert c.run([5, 42, 0, 7]) == 1  # a run of one, and every page the query found is touched
    assert list(c.pages)[-3:] == [5, 0, 7]
    c.write([9])  # 100% > 90%: target max(5%, 100 - 90 + 5 = 15%) of the 27 objects held before = 5 objects -> 2
    assert c.evictions == 2 and list(c.pages)[:2] == [3, 4] and 1 not in c.pages and 9 in c.pages
    c.write([10, 11, 12])  # 8 held + 3 > 100 bytes: room for 2, one put fails, and the master evicts
    assert c.put_failures == 1 and 12 not in c.pages and c.eviction_rounds == 2


def test_cluster_memory_is_the_pages_and_their_records_in_whole_mib():
    assert cluster_memory(5859, 8192, 0) == -(-5859 * (8192 + 44) // (1 << 20)) * (1 << 20)
    assert cluster_memory(None, 8192, 1000) >= 1000 * 8236 / 0.85
    with pytest.raises(Exception, match="under the 16 MiB Mooncake mounts at least"):
        cluster_memory(100, 8192, 0)


def _free(port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_the_cluster_is_torn_down_when_the_replay_raises(tmp_path, monkeypatch, error):
    runs = []
    enter = ClusterRun.__enter__

    def recorded(self):
        runs.append(self)
        return enter(self)

    monkeypatch.setattr(replay_cluster.ClusterRun, "__enter__", recorded)
    serve = replay_tiers.KvtierNode.serve
    calls = []

    def failing(self, ids):
        calls.append(ids)
        if len(calls) == 5:
            raise error("stop the replay")
        return serve(self, ids)

    monkeypatch.setattr(replay_tiers.KvtierNode, "serve", failing)
    reqs = tr.load(SAMPLE).requests
    with pytest.raises(error, match="stop the replay"):
        run(reqs, setup(tmp_path, 31, page_bytes=32768), nodes=1, store_pages=None, shared=True, routing="random",
            seed=0, label="boom", cluster_memory=16 << 20)
    (c,) = runs
    lc = c.cluster
    pids = [p.pid for p in c.cluster_pids]
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)  # the master and the storage process
    assert lc.master is None and lc.nodes == [None]
    _free(lc.rpc_port)
    _free(lc.metrics_port)
    assert c.tiers == []

