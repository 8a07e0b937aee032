"""The README's Python examples run as written: every ```python block, in order, in one namespace (as a
reader pasting them one after another would), on the CPU here and on the GPU where there is one."""

import os
import re
import tempfile

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def python_blocks():
    with open(README) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_python_examples():
    assert len(python_blocks()) >= 4


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' temporary store goes with the test
    ns: dict = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks()):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), ns)
        except Exception as exc:  # noqa: BLE001 - name the block that failed
            raise AssertionError(f"README python block {i + 1} failed: {exc!r}\n{block}") from exc


def test_readme_metrics_example_exports_samples(tmp_path, monkeypatch, capsys):
    """The metrics example prints live samples (it runs after the store example, with the store still open)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ns: dict = {"__name__": "__readme__"}
    for block in python_blocks():
        exec(compile(block, "README.md", "exec"), ns)
    out = capsys.readouterr().out
    assert "kvtier_store_objects{" in out, out[-500:]
