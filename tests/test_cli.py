"""The command line as an operator meets it: `import kvtier`, `--help`, `inspect` and `verify` do not import
torch (seconds saved on every call, and they work on a storage host without torch); bench options are
reachable with `kvtier bench NAME --help`, also for the GPU benches on a CPU machine."""

import subprocess
import sys

import torch

from kvtier import DeviceKVPool, PageStore, host_pool_for


def py(code, *args):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


def test_import_and_store_commands_do_not_import_torch(tmp_path):
    dp = DeviceKVPool(8 * 16, 16, 2, 2, 64, 64, torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(["a"], torch.arange(16)) == [True]
    code = """
import sys
import kvtier
from kvtier.cli import main
assert "torch" not in sys.modules, "import kvtier imported torch"
for argv in (["inspect", sys.argv[1]], ["verify", sys.argv[1]]):
    assert main(argv) == 0, argv
assert "torch" not in sys.modules, "inspect/verify imported torch"
print("ok")
"""
    r = py(code, str(tmp_path))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_without_torch_the_error_says_what_to_install():
    code = """
import sys
sys.modules["torch"] = None  # as if torch were not installed
import kvtier
try:
    kvtier.PageStore
except kvtier.KvtierError as e:
    print("error:", e)
"""
    r = py(code)
    assert r.returncode == 0 and "needs torch" in r.stdout and "pip install" in r.stdout, r.stdout + r.stderr


def test_bench_help_reaches_the_bench():
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvtier", *a], capture_output=True, text=True)
    r = run("bench", "store", "--help")
    assert r.returncode == 0 and "--reps" in r.stdout and "--cases" in r.stdout, r.stdout + r.stderr
    r = run("bench", "pin", "--help")  # a GPU bench: its options are readable on a CPU machine
    assert r.returncode == 0 and "usage: kvtier bench pin" in r.stdout, r.stdout + r.stderr
    r = run("bench")
    assert r.returncode == 2 and "kvtier bench NAME" in r.stdout
