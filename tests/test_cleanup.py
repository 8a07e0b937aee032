"""A Ctrl-C that lands while a command removes what it created is held until the tree is gone, then stops the
command: never dropped (a demo once ran to the end and exited 0 after a Ctrl-C that hit such a cleanup)."""

import os
import shutil
import signal

import pytest

from kvtier._cleanup import remove_tree


def test_ctrl_c_during_removal_is_raised_after_it(tmp_path, monkeypatch):
    root = tmp_path / "t"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f").write_bytes(b"x" * 100)
    real = shutil.rmtree

    def interrupted(path, ignore_errors=False):
        os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of the removal
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", interrupted)
    # Python's own Ctrl-C handler, whatever this runner inherited (a background job starts with SIGINT ignored)
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            remove_tree(str(root))
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)
    assert not root.exists()


def test_ignored_ctrl_c_stays_ignored(tmp_path, monkeypatch):
    """Where SIGINT is ignored (a background job), a removal neither raises nor un-ignores it."""
    root = tmp_path / "t"
    root.mkdir()
    real = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda p, ignore_errors=False: (os.kill(os.getpid(), signal.SIGINT),
                                                                        real(p, ignore_errors=ignore_errors)))
    outer = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        remove_tree(str(root))
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outer)
    assert not root.exists()


def test_removal_without_ctrl_c_raises_nothing(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    remove_tree(str(root))
    assert not root.exists()
