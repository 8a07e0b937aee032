"""The cluster tier across network namespaces: a master, two storage nodes and two inference nodes, each in its
own namespace, joined by veth pairs to a bridge in a sixth one, with a `tc` bandwidth cap on the inference
nodes' links. Node A writes pages, node B reads them through the cluster bit-exact and no faster than the cap;
then one storage node is killed: B's reads of its objects miss, the rest still hit, and no byte is wrong.

Needs root (``ip netns``); skipped with the reason elsewhere. Traffic stays inside the namespaces this test
creates; every process and namespace it starts is torn down, and every wait is bounded."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvtier.tiers._mooncake_env import binary, child_env

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")]
NET = "10.77.{}.{}"
RATE_MBIT = 400  # the cap on each inference node's link


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


@pytest.fixture
def netns():
    tag = f"kvt{os.getpid() % 10000}"
    names = {role: f"{tag}-{role}" for role in ("br", "master", "s0", "s1", "a", "b")}
    subnet = os.getpid() % 200 + 20
    addrs = {role: NET.format(subnet, i + 1) for i, role in enumerate(("master", "s0", "s1", "a", "b"))}
    procs: list[subprocess.Popen] = []
    try:
        for ns in names.values():
            sh("ip", "netns", "add", ns)
        sh("ip", "netns", "exec", names["br"], "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", names["br"], "ip", "link", "set", "br0", "up")
        for role, addr in addrs.items():
            ns, inner, outer = names[role], f"v-{role}", f"b-{role}"
            sh("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", names["br"])
            sh("ip", "netns", "exec", names["br"], "ip", "link", "set", outer, "master", "br0", "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", inner)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            if role in ("a", "b"):  # the cap: egress of the node and of its bridge port
                for n, dev in ((ns, inner), (names["br"], outer)):
                    sh("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                       f"{RATE_MBIT}mbit", "burst", "256kb", "latency", "50ms")
        yield names, addrs, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()
        for ns in names.values():
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                sh("kill", "-9", pid, check=False)
            sh("ip", "netns", "del", ns, check=False)


NODE = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from store_pools import make_pool, page_bytes, pages_idx
    from kvtier.tiers.mooncake import MooncakeTier
    role, master, me, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    t = MooncakeTier(master, model_name="org/netns", local_hostname=me)
    keys = [f"ns-{{i}}" for i in range(n)]
    if role == "write":
        hp = make_pool(seed=42, pages=n, layers=8, heads=4)
        t.register_mem_pool_host(hp)
        assert t.batch_set_v1(keys, pages_idx(range(n))) == [True] * n
        print("written", flush=True)
    else:
        ref = make_pool(seed=42, pages=n, layers=8, heads=4)
        hp = make_pool(seed=7, pages=n, layers=8, heads=4)
        t.register_mem_pool_host(hp)
        t0 = time.perf_counter()
        ok = t.batch_get_v1(keys, pages_idx(range(n)))
        dt = time.perf_counter() - t0
        wrong = sum(1 for i in range(n) if ok[i] and not all(torch.equal(a, b) for a, b in
                                                              zip(page_bytes(ref, i), page_bytes(hp, i))))
        print(f"hits={{sum(ok)}} wrong={{wrong}} seconds={{dt:.4f}} bytes={{sum(ok) * t.page_bytes}}", flush=True)
    t.close()
""")


def run_in(ns, *cmd, **kw):
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=child_env({"PYTHONPATH": os.path.dirname(__file__)}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE, **kw)


def wait_line(p, word, timeout):
    os.set_blocking(p.stdout.fileno(), False)
    buf, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        buf += p.stdout.read() or b""
        if word.encode() in buf:
            return buf.decode()
        if p.poll() is not None:
            raise AssertionError(f"exited {p.returncode}: {buf.decode()} {p.stderr.read().decode()[-1500:]}")
        time.sleep(0.05)
    raise AssertionError(f"no {word!r} within {timeout} s: {buf.decode()}")


def node(ns, script, role, master, me, n):
    r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(script), role, master, me, str(n)],
                       env=child_env({"PYTHONPATH": os.path.dirname(__file__)}), capture_output=True, text=True,
                       timeout=120)
    # (Mooncake's own log lines start with a glog level and a date: leave them out of the message)
    assert r.returncode == 0, "\n".join(x for x in r.stderr.splitlines() if x[:1] not in "IWE" or not x[1:5].isdigit())[-3000:]
    return r.stdout


def test_two_inference_nodes_share_pages_across_namespaces(tmp_path, netns):
    names, addrs, procs = netns
    master = f"{addrs['master']}:50051"
    procs.append(run_in(names["master"], binary("mooncake_master"), f"--rpc_address={addrs['master']}",
                        "--rpc_port=50051", f"--metrics_host={addrs['master']}", "--metrics_port=50052",
                        "--default_kv_lease_ttl=200", "--client_ttl=2"))
    time.sleep(1.0)
    for s in ("s0", "s1"):
        p = run_in(names[s], sys.executable, "-m", "kvtier.tiers._storage_node", "--master", master, "--hostname",
                   addrs[s], "--segment", str(256 << 20))
        procs.append(p)
        wait_line(p, "ready", 60)
    script = tmp_path / "node.py"
    script.write_text(NODE.format(tests=os.path.dirname(__file__)))
    n = 64  # 64 pages x 96 KiB
    assert "written" in node(names["a"], script, "write", master, addrs["a"], n)
    out = node(names["b"], script, "read", master, addrs["b"], n)
    stats = dict(kv.split("=") for kv in out.split())
    assert int(stats["hits"]) == n and int(stats["wrong"]) == 0, out
    gbps = int(stats["bytes"]) * 8 / float(stats["seconds"]) / 1e6
    assert gbps < RATE_MBIT * 1.3, f"{gbps:.0f} Mbit/s through a {RATE_MBIT} Mbit/s cap: not across the veth?"
    print(f"node B read {n} pages through the cluster at {gbps:.0f} Mbit/s (cap {RATE_MBIT} Mbit/s)")
    # a storage node dies: the pages it held miss, the others still hit, nothing wrong
    procs[2].kill()
    procs[2].wait(timeout=10)
    out = node(names["b"], script, "read", master, addrs["b"], n)
    stats = dict(kv.split("=") for kv in out.split())
    assert int(stats["wrong"]) == 0 and int(stats["hits"]) < n, out
