"""A named trace missing from every directory is downloaded on first use, kept only with the right sha256,
and a failed, short or wrong download leaves nothing behind. The server is a thread on 127.0.0.1 that this
test starts and stops; the known traces are replaced by the test sample (its own sha256)."""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
from pathlib import Path

import pytest

from kvtier._errors import KvtierError
from kvtier.replay import fetch as replay_fetch
from kvtier.replay import trace as tr

SAMPLE = Path(__file__).parent / "data" / "replay_sample.jsonl"


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""
    claimed: int | None = None  # a Content-Length other than the body's (a connection cut short)
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - the http.server API
        type(self).hits.append(self.path)
        if self.path.endswith("missing.jsonl"):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(self.claimed if self.claimed is not None else len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    _Handler.body, _Handler.claimed, _Handler.hits = SAMPLE.read_bytes(), None, []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    sha = hashlib.sha256(_Handler.body).hexdigest()
    monkeypatch.setitem(tr.KNOWN, "sample", tr.KnownTrace("sample_trace.jsonl", sha, 40, 41, 2.22))
    monkeypatch.setattr(tr, "_BY_SHA", {sha: "sample"})
    monkeypatch.setenv("KVTIER_TRACE_URL", f"http://127.0.0.1:{srv.server_address[1]}/traces")
    monkeypatch.setenv("KVTIER_TRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVTIER_TRACE_OFFLINE", raising=False)
    for var in ("no_proxy", "NO_PROXY"):  # a proxy set for the machine must not carry the loopback requests
        monkeypatch.setenv(var, "127.0.0.1,localhost")
    monkeypatch.delenv("KVTIER_TRACE_DIR", raising=False)
    monkeypatch.setattr(tr, "trace_dirs", lambda: [tmp_path / "nowhere", replay_fetch.cache_dir()])
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_a_missing_named_trace_is_downloaded_once_checked_and_kept(server, tmp_path):
    path, name = tr.resolve("sample")
    assert name == "sample" and Path(path) == tmp_path / "cache" / "sample_trace.jsonl"
    assert Path(path).read_bytes() == SAMPLE.read_bytes()
    assert _Handler.hits == ["/traces/sample_trace.jsonl"]
    trace = tr.load("sample")
    assert trace.known == "sample" and len(trace.requests) == len(SAMPLE.read_text().splitlines())
    server.shutdown()  # the second use needs no network
    assert tr.resolve("sample")[0] == path and len(_Handler.hits) == 1
    assert os.listdir(tmp_path / "cache") == ["sample_trace.jsonl"]
    assert os.stat(path).st_mode & 0o777 == 0o644, "others sharing the cache must read it"


def test_the_download_cache_is_searched(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_TRACE_CACHE", str(tmp_path / "cache"))
    assert tr.trace_dirs()[-1] == tmp_path / "cache"


def test_a_damaged_downloaded_copy_is_fetched_again(server, tmp_path, capsys):
    path, _ = tr.resolve("sample")
    Path(path).write_bytes(SAMPLE.read_bytes()[:-10])  # the cached copy cut short later
    trace = tr.load("sample")
    assert trace.known == "sample" and Path(path).read_bytes() == SAMPLE.read_bytes()
    assert "damaged" in capsys.readouterr().err and len(_Handler.hits) == 2


def test_too_large_a_response_is_refused(server, tmp_path, monkeypatch):
    monkeypatch.setattr(replay_fetch, "MAX_BYTES", 100)
    with pytest.raises(KvtierError, match="more than any known trace"):
        tr.resolve("sample")
    assert os.listdir(tmp_path / "cache") == []


@pytest.mark.parametrize("damage", ["other bytes", "cut short", "not found", "no server"])
def test_a_failed_download_leaves_nothing(server, tmp_path, damage):
    if damage == "other bytes":
        _Handler.body = SAMPLE.read_bytes().replace(b"2787", b"2788")
        match = "sha256 is .* not the sample trace's"
    elif damage == "cut short":
        _Handler.claimed = len(_Handler.body) + 1000
        match = "could not download|ended after"
    elif damage == "not found":
        tr.KNOWN["sample"] = tr.KnownTrace("missing.jsonl", tr.KNOWN["sample"].sha256, 40, 41, 2.22)
        match = "could not download .*missing.jsonl: Not Found"
    else:
        server.shutdown()
        server.server_close()
        match = "could not download"
    with pytest.raises(KvtierError, match=match):
        tr.resolve("sample")
    assert os.listdir(tmp_path / "cache") == [], "a failed download left a file behind"


def test_offline_never_downloads(server, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_TRACE_OFFLINE", "1")
    with pytest.raises(KvtierError, match="KVTIER_TRACE_OFFLINE is set"):
        tr.resolve("sample")
    assert _Handler.hits == []


def test_an_interrupted_download_leaves_nothing(server, tmp_path, monkeypatch):
    real = hashlib.sha256

    class Interrupting:
        def __init__(self):
            self.h = real()

        def update(self, b):
            raise KeyboardInterrupt  # Ctrl-C in the middle of the transfer

    monkeypatch.setattr(replay_fetch.hashlib, "sha256", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        tr.resolve("sample")
    assert os.listdir(tmp_path / "cache") == []


@pytest.mark.parametrize("where", ["under a file", "a directory no file can be made in"])
def test_an_unwritable_cache_is_a_clear_error(server, tmp_path, monkeypatch, where):
    (tmp_path / "file").write_text("x")
    # (as root, permission bits do not stop a write: /proc/self refuses new files to anyone)
    cache = tmp_path / "file" / "cache" if where == "under a file" else Path("/proc/self")
    monkeypatch.setenv("KVTIER_TRACE_CACHE", str(cache))
    with pytest.raises(KvtierError, match="cannot write the trace cache"):
        tr.resolve("sample")
    assert _Handler.hits == [], "nothing downloaded that could not be kept"
