"""The command line as an operator meets it: `import kvtier`, `--help`, `inspect` and `verify` do not import
torch (seconds saved on every call, and they work on a storage host without torch); bench options are
reachable with `python -m kvtier_bench NAME --help` from a checkout (the benches are not in the package), also for
the GPU benches on a CPU machine, and the replay's with `kvtier replay --help`; the demo runs from a checkout too
(`python -m kvtier_demo`, examples/kvtier_demo), and `kvtier demo` says so."""

import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from pathlib import Path

import torch

import kvtier
from kvtier import DeviceKVPool, PageStore, host_pool_for

from bench_checkout import bench_env, import_benches, run_bench
from demo_checkout import demo_cmd, demo_env, run_demo


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
for argv in (["inspect", sys.argv[1]], ["verify", sys.argv[1]], ["stats", sys.argv[1]], ["stats", "--json", sys.argv[1]],
             ["namespaces", sys.argv[1]], ["budget", sys.argv[1]], ["remove", sys.argv[1], "--all"]):
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
    r = run_bench("store", "--help")
    assert r.returncode == 0 and "--reps" in r.stdout and "--cases" in r.stdout, r.stdout + r.stderr
    r = run_bench("pin", "--help")  # a GPU bench: its options are readable on a CPU machine
    assert r.returncode == 0 and "usage: python -m kvtier_bench pin" in r.stdout, r.stdout + r.stderr
    r = run_bench()
    assert r.returncode == 2 and "python -m kvtier_bench NAME" in r.stdout
    run = lambda *a: subprocess.run([sys.executable, "-m", "kvtier", *a], capture_output=True, text=True)
    r = run("bench")
    assert r.returncode == 2 and "kvtier bench replay" in r.stdout


def test_a_bench_that_left_the_package_says_where_it_runs():
    """The benches run from a source checkout, not the installed package: `kvtier bench NAME` (with or without
    options, --help too) says where and how in one message, exit status 2, no traceback; `bench replay` still runs
    the trace replay (`kvtier replay`), which ships."""
    from kvtier.cli import MOVED_BENCHES, main

    assert MOVED_BENCHES == ("pin", "transfer", "store", "mooncake", "tenants")
    for name in MOVED_BENCHES:
        for extra in ((), ("--help",), ("--reps", "1")):
            r = kv("bench", name, *extra)
            assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, (name, extra, r.stderr)
            assert f"python -m kvtier_bench {name}" in r.stderr and "benches/python" in r.stderr, r.stderr
            assert "kvtier replay" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for argv in (["replay", "--help"], ["bench", "replay", "--help"]):
        r = kv(*argv)
        assert r.returncode == 0 and f"usage: kvtier {' '.join(argv[:-1])}" in r.stdout and "--trace" in r.stdout
    r = subprocess.run([sys.executable, "-m", "kvtier.replay", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: kvtier replay" in r.stdout, r.stderr
    assert "replay" in kv("--help").stdout
    package = Path(kvtier.__file__).parent
    assert not (package / "benchmarks").exists()
    imports = re.compile(r"^\s*(from|import)\s+kvtier_bench\b", re.M)
    assert not [f for f in package.rglob("*.py") if imports.search(f.read_text())], "the package imports no bench"
    assert main(["bench", "store", "--help"]) == 2  # (in this process too: the status, not an exception)


def test_the_demo_that_left_the_package_says_where_it_runs():
    """The demo runs from a source checkout (examples/kvtier_demo), not the installed package: `kvtier demo` (with
    or without options, --help too) says where and how, with the demo's options, in one message, exit status 2,
    no traceback; `python -m kvtier_demo --help` lists those options and needs no torch."""
    from kvtier.cli import main

    for extra in ((), ("--help",), ("--layers", "2", "--cluster")):
        r = kv("demo", *extra)
        assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, (extra, r.stderr)
        assert "make demo" in r.stderr and "python -m kvtier_demo" in r.stderr and "examples" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "demo" in kv("--help").stdout
    package = Path(kvtier.__file__).parent
    assert not (package / "demo").exists()
    imports = re.compile(r"^\s*(from|import)\s+kvtier_demo\b", re.M)
    assert not [f for f in package.rglob("*.py") if imports.search(f.read_text())], "the package imports no demo"
    assert main(["demo", "--seed", "1"]) == 2  # (in this process too: the status, not an exception)
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None\n"
                        "from kvtier_demo.__main__ import main\nsys.exit(main(['--help']))"],
                       capture_output=True, text=True, env=demo_env())
    assert r.returncode == 0 and "usage: python -m kvtier_demo" in r.stdout, r.stdout + r.stderr
    options = re.findall(r"--[a-z-]+", r.stdout)
    moved = kv("demo").stderr
    assert options and all(o in moved for o in options if o != "--help"), (options, moved)


def test_bench_help_needs_no_torch():
    """`python -m kvtier_bench NAME --help` and `kvtier replay --help` answer on a machine without torch (the
    top-level help sends users there), from the benches' own option definitions (kvtier_bench.options, and
    kvtier.replay.options for the replay), whose case names are the benches' own."""
    import_benches()
    from kvtier_bench import mooncake, options, store

    assert options.STORE_CASES == tuple(store.CASES) and options.MOONCAKE_CASES == tuple(mooncake.CASES)
    names = ("pin", "transfer", "store", "mooncake", "tenants")
    code = ("import sys; sys.modules['torch'] = None\nfrom kvtier_bench.__main__ import main\n"
            "for name in sys.argv[1:]:\n    assert main([name, '--help']) == 0, name\n"
            "from kvtier.cli import main\nassert main(['replay', '--help']) == 0\n"
            "assert main(['bench', 'replay', '--help']) == 0\n"
            "assert 'torch' not in sys.modules or sys.modules['torch'] is None\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, env=bench_env())
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr
    for name in names:
        assert f"usage: python -m kvtier_bench {name}" in r.stdout, name
    assert "usage: kvtier replay" in r.stdout and "usage: kvtier bench replay" in r.stdout
    assert "--trace" in r.stdout and "--cluster-cases" in r.stdout and "['mimo', 'small']" in r.stdout


def kv(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, cwd=cwd)


def test_demo_arguments_are_checked_before_any_work(tmp_path):
    for args, word in ((["--pages", "-5"], "--pages"), (["--turns", "0"], "--turns"), (["--layers", "0"], "--layers")):
        r = run_demo(*args, cwd=tmp_path)
        assert r.returncode == 1 and word in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = run_demo("--store-dir", str(tmp_path / "no" / "such" / "tree"))
    assert r.returncode == 1 and "not an existing directory" in r.stderr and not (tmp_path / "no").exists(), r.stderr
    for args, word in ((["--store-dir", ""], "--store-dir"), (["--seed", str(2**70)], "--seed"),
                       (["--layers", "100000"], "--layers"), (["--window", "0"], "--window"),
                       (["--window", "two"], "--window"), (["--window", "-1"], "--window"),
                       (["--window", "²"], "--window"), (["--window", "2", "--cluster"], "--window")):
        r = run_demo(*args, cwd=tmp_path)
        assert r.returncode == 1 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    (tmp_path / "file").write_text("x")
    r = run_demo("--store-dir", str(tmp_path / "file"))
    assert r.returncode == 1 and "not a directory" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "file"], "nothing written in the working directory"


def test_ctrl_c_during_the_demo_is_one_line(tmp_path):
    import signal
    import time

    # a terminal's Ctrl-C: SIGINT at its default in the demo, whatever this runner inherited (a background job
    # of a non-interactive shell starts with SIGINT ignored, and Python keeps it so)
    p = subprocess.Popen(demo_cmd("--store-dir", str(tmp_path / "s")), env=demo_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "s").exists():  # the demo is at work
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.strip() == "kvtier_demo: interrupted", (p.returncode, err[-2000:])


def _store(tmp_path):
    dp = DeviceKVPool(8 * 16, 16, 2, 2, 64, 64, torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(["a", "b"], torch.arange(32)) == [True, True]


def _tree(path):
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[p] = (hashlib.sha256(fh.read()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


def test_stats_prints_counters_and_changes_nothing(tmp_path):
    _store(tmp_path)
    before = _tree(tmp_path)
    r = subprocess.run([sys.executable, "-m", "kvtier", "stats", "--json", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (ns,) = json.loads(r.stdout).values()
    assert ns["objects"] == 4 and "|heads=2|k=64|v=64" in ns["namespace"]
    r = subprocess.run([sys.executable, "-m", "kvtier", "stats", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0 and "objects" in r.stdout
    assert _tree(tmp_path) == before
    r = subprocess.run([sys.executable, "-m", "kvtier", "stats", str(tmp_path / "nope")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("kvtier: error:") and "Traceback" not in r.stderr


def test_version_and_start_time(tmp_path):
    """--help, --version, inspect and stats start within a second of a bare interpreter (compared in the same
    run: machines are noisy)."""
    _store(tmp_path)
    r = subprocess.run([sys.executable, "-m", "kvtier", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("kvtier ") and r.stdout.split()[1][0].isdigit()

    def median(argv):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, *argv], capture_output=True, check=True)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    bare = median(["-c", "pass"])
    for argv in (["--help"], ["--version"], ["inspect", str(tmp_path)], ["stats", str(tmp_path)]):
        assert median(["-m", "kvtier", *argv]) < bare + 1.0, argv


def test_bench_store_writes_only_where_told_and_plots(tmp_path):
    run = lambda *a, cwd=tmp_path: run_bench(*a, cwd=cwd)
    quick = ("store", "--reps", "1", "--pages", "8", "--cases", "small")
    r = run(*quick)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| small |" in r.stdout and list(tmp_path.iterdir()) == []  # printed; nothing left behind
    r = run(*quick, "--dir", "nosuch")  # a --dir the run created goes with it; one that existed stays
    assert r.returncode == 0 and list(tmp_path.iterdir()) == [], r.stderr[-2000:]
    (tmp_path / "mine").mkdir()
    assert run(*quick, "--dir", "mine").returncode == 0 and (tmp_path / "mine").is_dir()
    (tmp_path / "mine").rmdir()
    with open("/proc/mounts") as f:
        mounts = f.read()
    fs = r.stdout.split("disk: ")[1].split(" on ")[0]
    assert f" {fs} " in mounts and fs not in ("ext2/ext3", "?"), r.stdout[:300]  # the type /proc/mounts names
    png = tmp_path / "store.png"
    r = run(*quick, "--out", str(tmp_path / "out"), "--plot", str(png))
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["store.json", "store.md"]
    import matplotlib.image

    img = matplotlib.image.imread(png)  # a readable PNG with something drawn on it
    assert img.shape[0] > 200 and img.shape[1] > 400 and img.std() > 0.05
    # a destination that cannot be written fails at once, before any work
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    t0 = time.perf_counter()
    r = run("store", "--out", str(ro / "x"), "--cases", "small")
    if os.geteuid() != 0:  # (root writes anywhere)
        assert r.returncode == 1 and "--out" in r.stderr and time.perf_counter() - t0 < 10
    r = run("store", "--plot", "/nonexistent/dir/x.png", "--cases", "small")
    assert r.returncode == 1 and "--plot" in r.stderr and "Traceback" not in r.stderr
    r = run("store", "--cases", "huge")
    assert r.returncode == 2 and "unknown ['huge']" in r.stderr


def test_progress_is_drawn_for_slow_work_and_errors_pass_through():
    import io

    from kvtier._progress import Progress, run_with_progress

    out = io.StringIO()
    assert not Progress(10, "x", delay=0, stream=io.StringIO()).enabled  # not a terminal: nothing drawn
    bar = Progress(10, "verifying", delay=0, stream=out, force=True)
    for i in range(11):
        bar.update(i)
    bar.close()
    assert "verifying [" in out.getvalue() and "10/10" in out.getvalue() and out.getvalue().endswith("\n")
    state = {"n": 0}

    def work():
        for _ in range(15):
            state["n"] += 1
            time.sleep(0.1)
        return "done"

    assert run_with_progress(work, lambda: (state["n"], 15), "x", interval=0.05) == "done"

    def boom():
        raise OSError(5, "disk on fire")

    try:
        run_with_progress(boom, lambda: (0, 1), "x")
    except OSError as e:
        assert "disk on fire" in str(e)
    else:
        raise AssertionError("the work's exception must reach the caller")


def test_a_reader_that_leaves_early_gets_no_error(tmp_path):
    _store(tmp_path)
    r = subprocess.run(f"{sys.executable} -m kvtier stats {tmp_path} | head -c 1", shell=True, capture_output=True, text=True)
    assert r.stderr == "" and len(r.stdout) == 1


def test_copied_namespace_directory_is_reported_not_silently_checked(tmp_path):
    """A copy of a namespace directory (ns-X.bak) names ns-X in its NAMESPACE file: opening it would open
    the original. verify reports it as damage (exit 1); inspect and stats say so and go on."""
    import shutil

    _store(tmp_path)
    (ns,) = [p for p in tmp_path.iterdir() if p.name.startswith("ns-")]
    shutil.copytree(ns, tmp_path / (ns.name + ".bak"))
    r = kv("verify", str(tmp_path))
    assert r.returncode == 1 and ".bak: DAMAGED" in r.stdout and "copied or renamed" in r.stdout, r.stdout + r.stderr
    r = kv("inspect", str(tmp_path))
    assert r.returncode == 0 and "copied or renamed" in r.stdout and "objects 4" in r.stdout, r.stdout + r.stderr
    r = kv("stats", "--json", str(tmp_path))
    got = json.loads(r.stdout)
    assert got[ns.name]["objects"] == 4 and "damage" in got[ns.name + ".bak"]
    # traffic and capacity are the writer's (its STATS file), never the read-only opener's own zeros
    assert got[ns.name]["puts"] == 4 and got[ns.name]["capacity_bytes"] == 1 << 30
    assert got[ns.name]["counters_writer"] == f"pid {os.getpid()}, ended"


def test_bench_plot_and_out_are_checked_first_and_created_last(tmp_path):
    for plot in ("results", str(tmp_path), "x.bogusext", "sub/"):
        r = run_bench("store", "--cases", "small", "--pages", "8", "--reps", "1", "--plot", plot, cwd=tmp_path)
        assert r.returncode == 1 and "--plot" in r.stderr and "Traceback" not in r.stderr, (plot, r.stderr)
    r = run_bench("store", "--cases", "small", "--pages", "8", "--reps", "1", "--out", "newdir", "--plot", "x.bogus",
                  cwd=tmp_path)
    assert r.returncode == 1 and list(tmp_path.iterdir()) == [], "a refused run creates nothing"


def test_commands_that_need_torch_say_so_in_one_line():
    for module, argv in (("kvtier_demo.__main__", []), ("kvtier.cli", ["replay", "--trace", "x"]),
                         ("kvtier_bench.__main__", ["store", "--reps", "1"])):  # (`NAME --help` needs none)
        code = (f"import sys; sys.modules['torch'] = None\nfrom {module} import main\n"
                f"sys.exit(main({argv!r}))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=demo_env(bench_env()))
        assert r.returncode == 1 and "needs torch" in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1


def test_verify_repair_fails_on_damage_it_does_not_repair(tmp_path):
    """A copied namespace directory is reported DAMAGED and left alone by --repair: the exit status must not
    say success (it was 0)."""
    _store(tmp_path)
    (ns,) = [p for p in tmp_path.iterdir() if p.name.startswith("ns-")]
    shutil.copytree(ns, tmp_path / (ns.name + ".bak"))
    r = kv("verify", "--repair", str(tmp_path))
    assert r.returncode == 1 and "not repaired" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / (ns.name + ".bak")).exists()
    shutil.rmtree(tmp_path / (ns.name + ".bak"))
    r = kv("verify", "--repair", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_empty_path_and_an_os_error_read_as_an_operator_expects():
    """An empty PATH is named as such (it printed `error: : no such store directory`); an OSError is the file,
    then what went wrong, not Python's `[Errno N] ...: 'file'`."""
    from kvtier.cli import os_error_text

    for cmd in ("inspect", "stats", "verify", "namespaces", "budget"):
        r = kv(cmd, "")
        assert r.returncode == 2 and "PATH must name a store directory, got an empty string" in r.stderr, r.stderr
    assert os_error_text(PermissionError(13, "Permission denied", "/srv/kv")) == "/srv/kv: Permission denied"
    assert os_error_text(OSError(18, "Invalid cross-device link", "/a", None, "/b")) == "/a -> /b: Invalid cross-device link"
    assert os_error_text(OSError("journal poisoned; reopen the store")) == "journal poisoned; reopen the store"



def test_every_readme_section_the_package_names_exists():
    """Messages and help that send a user to a README section name one that is there (the CLI pointed to a
    'Cluster tier' section the README did not have)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    headings = [line.lstrip("#").strip() for line in (root / "README.md").read_text().splitlines()
                if line.startswith("## ")]
    named = {m for f in (root / "python" / "kvtier").rglob("*.py")
             for m in re.findall(r"README ['\"]([^'\"]+)['\"]", f.read_text())}
    assert named, "the package names README sections"
    for section in named:
        assert any(h.startswith(section) for h in headings), (section, headings)
