"""The Python examples of the README and of docs/API.md run as written: every ```python block of a file, in
order, in one namespace (as a reader pasting them one after another would), on the CPU here and on the GPU
where there is one."""

import os
import re
import tempfile

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
README = os.path.join(ROOT, "README.md")
API = os.path.join(ROOT, "docs", "API.md")


def python_blocks(path=README):
    with open(path) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def run_blocks(path, tmp_path, monkeypatch) -> dict:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' temporary stores go with the test
    ns: dict = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks(path)):
        try:
            exec(compile(block, f"{os.path.basename(path)} python block {i + 1}", "exec"), ns)
        except Exception as exc:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"{os.path.basename(path)} python block {i + 1} failed: {exc!r}\n{block}") from exc
    return ns


def test_readme_and_api_doc_have_python_examples():
    assert len(python_blocks(README)) >= 2
    assert len(python_blocks(API)) >= 5


@pytest.mark.parametrize("path", [README, API], ids=["README", "API"])
def test_python_blocks_run(path, tmp_path, monkeypatch):
    run_blocks(path, tmp_path, monkeypatch)


def test_api_metrics_example_exports_samples(tmp_path, monkeypatch, capsys):
    """The metrics example prints live samples (it runs after the store example, with the store still open)."""
    run_blocks(API, tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "kvtier_store_objects{" in out, out[-500:]


def test_every_doc_link_resolves():
    """Links from the README and the docs to files of the repository point at files that exist."""
    missing = []
    for path in [README] + [os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))]:
        if not path.endswith(".md"):
            continue
        with open(path) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)#:]+?)(?:#[^)]*)?\)", text):
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), target))):
                missing.append(f"{os.path.relpath(path, ROOT)} -> {target}")
    assert not missing, missing
