"""The README's cluster commands, run as they are written: each line of its `cluster-commands` block starts in
the background (`&`, so with no terminal and standard input from /dev/null) inside a network namespace of its
own holding the address the line names (the storage node's 64G segment made 256M); an inference node in a third
namespace (10.0.0.5, as the README's SGLang config) writes pages through the cluster and reads them back
bit-exact; then SIGTERM stops both processes cleanly. Also the storage node's service behaviour on loopback:
SIGINT, --log, and clear errors.

Needs root for the namespaces (skipped with the reason elsewhere) and Mooncake. Traffic stays on loopback or
inside the namespaces this test creates; every process and namespace it starts is torn down; every wait is
bounded."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvtier.tiers._mooncake_env import child_env

pytestmark = pytest.mark.timeout(180)
README = Path(__file__).resolve().parent.parent / "README.md"
ROOT = os.geteuid() == 0


def readme_commands() -> list[str]:
    text = README.read_text()
    block = text.split("<!-- cluster-commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def kvtier_env() -> dict[str, str]:
    """The environment the README's commands run with: kvtier's console script on PATH."""
    bindir = os.path.dirname(sys.executable)
    return child_env({"PATH": bindir + os.pathsep + os.environ.get("PATH", "")})


def wait_for(path: Path, word: str, timeout: float, procs=()) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if word in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"no {word!r} in {path} within {timeout} s:\n{text[-2000:]}")


def test_the_readme_names_the_public_commands():
    lines = readme_commands()
    assert len(lines) == 2
    assert lines[0].startswith("kvtier cluster master ") and lines[0].endswith("&")
    assert lines[1].startswith("kvtier cluster storage-node ") and lines[1].endswith("&")
    assert "_storage_node" not in README.read_text()  # the private module is not what users are told to run


@pytest.fixture
def namespaces():
    tag = f"kvs{os.getpid() % 10000}"
    roles = ("br", "master", "storage", "client")
    names = {r: f"{tag}-{r}" for r in roles}
    try:
        for ns in names.values():
            sh("ip", "netns", "add", ns)
        sh("ip", "netns", "exec", names["br"], "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", names["br"], "ip", "link", "set", "br0", "up")
        for role, addr in (("master", "10.0.0.1"), ("storage", "10.0.0.2"), ("client", "10.0.0.5")):
            ns, inner, outer = names[role], f"v-{role[:6]}", f"b-{role[:6]}"
            sh("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", names["br"])
            sh("ip", "netns", "exec", names["br"], "ip", "link", "set", outer, "master", "br0", "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", inner)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield names
    finally:
        for ns in names.values():
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                sh("kill", "-9", pid, check=False)
            sh("ip", "netns", "del", ns, check=False)


CLIENT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from store_pools import make_pool, page_bytes, pages_idx
    from kvtier.tiers.mooncake import MooncakeTier
    n = 8
    writer = MooncakeTier("10.0.0.1:50051", model_name="org/readme-cluster", local_hostname="10.0.0.5")
    src = make_pool(seed=42, pages=n, layers=4, heads=2)
    writer.register_mem_pool_host(src)
    keys = [f"readme-{{i}}" for i in range(n)]
    assert writer.batch_set_v1(keys, pages_idx(range(n))) == [True] * n
    dst = make_pool(seed=7, pages=n, layers=4, heads=2)
    writer.register_mem_pool_host(dst)
    ok = writer.batch_get_v1(keys, pages_idx(range(n)))
    same = all(torch.equal(a, b) for i in range(n) for a, b in zip(page_bytes(src, i), page_bytes(dst, i)))
    print(f"hits={{sum(ok)}} same={{same}}", flush=True)
    writer.close()
""")


@pytest.mark.skipif(not ROOT, reason="network namespaces need root")
def test_the_readme_cluster_commands_run_in_the_background(tmp_path, namespaces):
    master_line, storage_line = readme_commands()
    storage_line = storage_line.replace("--segment 64G", "--segment 256M")
    logs = {}
    for role, line in (("master", master_line), ("storage", storage_line)):
        logs[role] = tmp_path / f"{role}.log"
        with open(logs[role], "wb") as out:
            # the line as a shell runs it: `&` puts it in the background with standard input from /dev/null
            r = subprocess.run(["ip", "netns", "exec", namespaces[role], "bash", "-c", line], stdout=out,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=kvtier_env(), timeout=30)
        assert r.returncode == 0
        if role == "master":
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the master listens (from inside its namespace)
                probe = subprocess.run(["ip", "netns", "exec", namespaces["master"], sys.executable, "-c",
                                        "import socket; socket.create_connection(('10.0.0.1', 50051), 1)"],
                                       capture_output=True, timeout=10)
                if probe.returncode == 0:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"the master did not listen: {logs['master'].read_text()[-2000:]}")
    text = wait_for(logs["storage"], "ready", 30)
    assert "10.0.0.2" in text and "lends 268435456 bytes" in text
    time.sleep(2)  # nothing holds its standard input: it must still be serving
    assert sh("ip", "netns", "pids", namespaces["storage"]).stdout.split(), logs["storage"].read_text()[-2000:]
    script = tmp_path / "client.py"
    script.write_text(CLIENT.format(tests=os.path.dirname(__file__)))
    r = subprocess.run(["ip", "netns", "exec", namespaces["client"], sys.executable, str(script)],
                       env=kvtier_env(), capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hits=8 same=True" in r.stdout
    for role in ("storage", "master"):  # SIGTERM: each stops by itself, cleanly
        pids = sh("ip", "netns", "pids", namespaces[role]).stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGTERM)
        deadline = time.monotonic() + 20
        while sh("ip", "netns", "pids", namespaces[role]).stdout.split() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not sh("ip", "netns", "pids", namespaces[role]).stdout.split(), f"{role} ignored SIGTERM"
    assert "stopped" in logs["storage"].read_text()


def free_port() -> int:
    from kvtier.tiers.local_cluster import free_port as fp

    return fp()


def test_storage_node_service_on_loopback(tmp_path):
    """No terminal, no stdin, --log: serves until SIGINT, then exits 0 having said so in its log."""
    from kvtier.tiers._mooncake_env import binary

    try:
        master_bin = binary("mooncake_master")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"Mooncake not installed: {exc}")
    port = free_port()
    master = subprocess.Popen([sys.executable, "-m", "kvtier", "cluster", "master", "--rpc_address=127.0.0.1",
                               f"--rpc_port={port}", "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=kvtier_env())
    node = None
    try:
        assert os.path.exists(master_bin)
        import socket

        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and master.poll() is None, "the master did not start"
                time.sleep(0.1)
        log = tmp_path / "node.log"
        node = subprocess.Popen([sys.executable, "-m", "kvtier", "cluster", "storage-node", "--master",
                                 f"127.0.0.1:{port}", "--segment", "64M", "--log", str(log)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=kvtier_env())
        wait_for(log, "ready", 30)
        time.sleep(1.5)
        assert node.poll() is None, log.read_text()[-2000:]
        node.send_signal(signal.SIGINT)
        assert node.wait(timeout=20) == 0
        assert re.search(r"storage node 127\.0\.0\.1: stopped", log.read_text())
        master.send_signal(signal.SIGTERM)
        master.wait(timeout=20)
    finally:
        for p in (node, master):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.mark.parametrize("args, says", [
    (["--master", "nohost", "--segment", "1G"], "expected HOST:PORT"),
    (["--master", "127.0.0.1:5", "--segment", "lots"], "--segment"),
    (["--master", "127.0.0.1:5", "--segment", "1G", "--log", "/nonexistent-dir/x.log"], "--log"),
])
def test_storage_node_refuses_bad_arguments_in_one_line(args, says):
    r = subprocess.run([sys.executable, "-m", "kvtier", "cluster", "storage-node", *args], capture_output=True,
                       text=True, timeout=60, env=kvtier_env())
    assert r.returncode != 0
    assert says in r.stderr and "Traceback" not in r.stderr


def _fake_mooncake(root: Path, *, missing_lib: bool) -> Path:
    """A directory holding a package named mooncake whose mooncake_master is a small C program (printing its
    arguments) that, with ``missing_lib``, links a shared library then deleted: what a machine without
    libibverbs1 gives Mooncake's real master."""
    pkg = root / "mooncake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    src = root / "main.c"
    src.write_text('#include <stdio.h>\nint gone(void);\nint main(int c, char **v) {\n'
                   + ('  gone();\n' if missing_lib else '') + '  for (int i = 1; i < c; i++) printf("arg %s\\n", v[i]);\n'
                   '  return 0;\n}\n')
    cmd = ["cc", "-o", str(pkg / "mooncake_master"), str(src)]
    if missing_lib:
        (root / "gone.c").write_text("int gone(void) { return 0; }\n")
        sh("cc", "-shared", "-fPIC", "-o", str(root / "libkvtiergone.so"), str(root / "gone.c"))
        cmd += [f"-L{root}", "-lkvtiergone"]
    sh(*cmd)
    (root / "libkvtiergone.so").unlink(missing_ok=True)
    return root


@pytest.mark.skipif(not any(os.access(os.path.join(d, "cc"), os.X_OK) for d in os.environ.get("PATH", "").split(":")),
                    reason="needs a C compiler")
def test_cluster_master_needs_no_torch_and_names_missing_libraries(tmp_path):
    """`kvtier cluster master` starts Mooncake's master without torch and passes its arguments; a master whose
    system libraries are missing is one clear error naming them and the fix (it was the loader's raw message
    and exit status 127); without Mooncake the install advice is said once."""
    code = ("import sys; sys.modules['torch'] = None\nfrom kvtier.cli import main\n"
            "sys.exit(main(['cluster', 'master', *sys.argv[1:]]))")

    def master(pythonpath, *args):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), *sys.path])}
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                              timeout=60)

    r = master(_fake_mooncake(tmp_path / "ok", missing_lib=False), "--rpc_port=50123")
    assert r.returncode == 0 and r.stdout == "arg --rpc_port=50123\n", r.stdout + r.stderr
    r = master(_fake_mooncake(tmp_path / "libs", missing_lib=True), "--rpc_port=50123")
    assert r.returncode == 1 and "libkvtiergone.so are missing" in r.stderr and "apt-get install libibverbs1" in \
        r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    (tmp_path / "none" / "mooncake").mkdir(parents=True)  # a package with no master binary
    (tmp_path / "none" / "mooncake" / "__init__.py").write_text("")
    r = master(tmp_path / "none")
    assert r.returncode == 1 and r.stderr.count("pip install 'kvtier[mooncake]'") == 1, r.stderr
