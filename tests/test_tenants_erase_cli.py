"""`kvtier erase` and `kvtier keys` as an operator runs them: every prerequisite checked before anything
changes (a mistyped keyring, an unreachable or uninstalled cluster tier, a sealed namespace without its
keyring), the salt kept off the command line, Unicode spellings of one salt, and an erased tenant allowed
again only by `kvtier keys allow` (docs/SECURITY.md, "Erasure by tenant")."""

import json
import os
import subprocess
import sys

import pytest

from kvtier import PageStore, page_hashes
from kvtier.tenants import Keyring

from store_pools import PS, make_pool, pages_idx

TOKENS = list(range(7000, 7000 + 4 * PS))


def _kvtier(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "kvtier", *map(str, args)], capture_output=True, text=True,
                          timeout=120, input=stdin)


def _fill(path, salt, keyring=None, hp=None, **kw):
    hp = hp or make_pool(seed=1)
    keys = page_hashes(TOKENS[: 2 * PS], PS, salt=salt)
    with PageStore(path, capacity_bytes=1 << 30, keyring=keyring, **kw) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(keys, pages_idx([0, 1])))
    return hp, keys


def _stored(path, hp, keys, keyring=None, **kw):
    with PageStore(path, capacity_bytes=1 << 30, keyring=keyring, **kw) as st:
        st.register_mem_pool_host(hp)
        return st.batch_exists(keys)


def test_a_mistyped_keyring_erases_nothing(tmp_path):
    hp, keys = _fill(tmp_path / "s", "alice")
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--keyring", tmp_path / "kyes", "--yes")
    assert r.returncode != 0 and "keyring" in r.stderr, r.stdout + r.stderr
    assert _stored(tmp_path / "s", hp, keys) == 2, "disk objects erased before the keyring was checked"


def test_an_unreachable_cluster_erases_nothing(tmp_path):
    hp, keys = _fill(tmp_path / "s", "alice")
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--cluster", "127.0.0.1:9", "--yes")
    assert r.returncode != 0 and "--cluster" in r.stderr and "nothing was erased" in r.stderr, r.stdout + r.stderr
    assert _stored(tmp_path / "s", hp, keys) == 2
    # the dry run does not promise a cluster it cannot reach either
    dry = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--cluster", "127.0.0.1:9")
    assert dry.returncode != 0 and "would remove" not in dry.stdout


def test_without_the_cluster_tiers_packages_a_cluster_erase_erases_nothing(tmp_path):
    """The README's plain install has no torch: `--cluster` must stop before the disk is touched."""
    hp, keys = _fill(tmp_path / "s", "alice")
    code = ("import sys; sys.modules['torch'] = None; sys.modules['mooncake'] = None\n"
            "from kvtier.cli import main\n"
            f"sys.exit(main(['erase', {str(tmp_path / 's')!r}, '--tenant', 'alice', '--cluster', '127.0.0.1:9', "
            "'--yes']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--cluster" in r.stderr, r.stdout + r.stderr
    assert _stored(tmp_path / "s", hp, keys) == 2


def test_a_sealed_namespace_without_its_keyring_is_kept_and_named(tmp_path):
    kr = Keyring.init(tmp_path / "keys")
    hp, keys = _fill(tmp_path / "s", "alice", keyring=kr)
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--yes")
    assert r.returncode == 1 and "sealed" in r.stdout and "--keyring" in r.stdout, r.stdout
    assert kr.has_key("alice") and _stored(tmp_path / "s", hp, keys, kr) == 2
    other = Keyring.init(tmp_path / "other")
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--keyring", tmp_path / "other", "--yes")
    assert r.returncode == 1 and "another keyring" in r.stdout, r.stdout
    assert not other.erased("alice") or _stored(tmp_path / "s", hp, keys, kr) == 2
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--keyring", tmp_path / "keys", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _stored(tmp_path / "s", hp, keys, kr) == 0 and kr.erased("alice")


def test_the_salt_comes_from_a_file_or_stdin_and_never_shows_on_the_command_line(tmp_path):
    hp, keys = _fill(tmp_path / "s", "acct-7731-secret")
    salt_file = tmp_path / "salt"
    salt_file.write_text("acct-7731-secret\n")
    dry = _kvtier("erase", tmp_path / "s", "--tenant-file", salt_file)
    assert dry.returncode == 0 and "would erase 4 object(s)" in dry.stdout, dry.stdout + dry.stderr
    r = _kvtier("erase", tmp_path / "s", "--tenant-file", "-", "--yes", stdin="acct-7731-secret\n")
    assert r.returncode == 0 and "4 object(s) of the tenant erased" in r.stdout, r.stdout + r.stderr
    assert _stored(tmp_path / "s", hp, keys) == 0
    (tmp_path / "empty").write_text("\n")
    bad = _kvtier("erase", tmp_path / "s", "--tenant-file", tmp_path / "empty", "--yes")
    assert bad.returncode != 0 and "--tenant-file" in bad.stderr


def test_two_unicode_spellings_of_one_salt_are_one_tenant(tmp_path):
    hp, keys = _fill(tmp_path / "s", "caf\u00e9")
    assert page_hashes(TOKENS[: 2 * PS], PS, salt="cafe\u0301") == keys
    r = _kvtier("erase", tmp_path / "s", "--tenant", "cafe\u0301", "--yes")
    assert r.returncode == 0 and "4 object(s) of the tenant erased" in r.stdout, r.stdout
    assert _stored(tmp_path / "s", hp, keys) == 0


def test_an_erased_tenant_stays_erased_until_keys_allow(tmp_path):
    kr = Keyring.init(tmp_path / "keys")
    hp, keys = _fill(tmp_path / "s", "alice", keyring=kr)
    r = _kvtier("erase", "--tenant", "alice", "--keyring", tmp_path / "keys", "--yes")
    assert r.returncode == 0 and "no new one until" in r.stdout, r.stdout + r.stderr
    listed = _kvtier("keys", "list", tmp_path / "keys")
    assert f"{kr.stored_tag('alice')} (erased)" in listed.stdout and "alice" not in listed.stdout
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=kr) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(keys, pages_idx([0, 1])) == [False, False]
    (tmp_path / "salt").write_text("alice")
    allow = _kvtier("keys", "allow", tmp_path / "keys", "--tenant-file", tmp_path / "salt")
    assert allow.returncode == 0 and "allowed again" in allow.stdout, allow.stdout + allow.stderr
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30, keyring=kr) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(keys, pages_idx([0, 1])) == [True, True]
    again = _kvtier("keys", "allow", tmp_path / "keys", "--tenant", "alice")
    assert again.returncode == 0 and "was not erased" in again.stdout
    assert _kvtier("keys", "allow", tmp_path / "keys").returncode != 0


def test_a_dry_run_changes_nothing_and_says_so(tmp_path):
    kr = Keyring.init(tmp_path / "keys")
    hp, keys = _fill(tmp_path / "s", "alice", keyring=kr)
    before = sorted(os.listdir(tmp_path / "keys" / "tenants"))
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--keyring", tmp_path / "keys")
    assert r.returncode == 0 and "nothing erased" in r.stdout and "would erase 4 object(s)" in r.stdout, r.stdout
    assert sorted(os.listdir(tmp_path / "keys" / "tenants")) == before
    assert _stored(tmp_path / "s", hp, keys, kr) == 2 and not kr.erased("alice")



@pytest.mark.parametrize("command", ["erase", "verify --repair"])
def test_erase_and_repair_that_change_nothing_keep_the_engines_counters(tmp_path, command):
    """`kvtier erase --yes` and `kvtier verify --repair` open a namespace for maintenance: the counters and the
    capacity its engine left in STATS are what `kvtier stats` still shows (docs/STORE.md, "Counters on disk")."""
    hp, keys = _fill(tmp_path / "s", "alice")
    with PageStore(tmp_path / "s", capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_get_v1(keys, pages_idx([2, 3])) == [True, True]
        assert st.batch_get_v1(page_hashes(TOKENS[: 2 * PS], PS, salt="bob"), pages_idx([2, 3])) == [False, False]

    def stats():
        r = _kvtier("stats", "--json", tmp_path / "s")
        assert r.returncode == 0, r.stdout + r.stderr
        (st,) = json.loads(r.stdout).values()
        return st

    kept = ("hits", "misses", "bytes_read", "puts", "bytes_written", "evictions", "capacity_bytes", "objects",
            "bytes_used", "counters_since", "counters_writer")
    before = stats()
    assert before["hits"] == 4 and before["misses"] > 0 and before["capacity_bytes"] == 1 << 30, before
    if command == "erase":
        (tmp_path / "salt").write_text("nobody\n")  # a tenant with nothing stored
        r = _kvtier("erase", tmp_path / "s", "--tenant-file", tmp_path / "salt", "--yes")
        assert r.returncode == 0 and "0 object(s) of the tenant erased" in r.stdout, r.stdout + r.stderr
    else:
        r = _kvtier("verify", "--repair", tmp_path / "s")
        assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    after = stats()
    assert {k: after.get(k) for k in kept} == {k: before[k] for k in kept}, (before, after)
    with open(tmp_path / "s" / after["dir"].rsplit("/", 1)[1] / "STATS", encoding="utf-8") as f:
        assert json.load(f)["maintained_unix_ms"] > 0
    assert _stored(tmp_path / "s", hp, keys) == 2


def test_a_sealed_namespace_whose_model_name_holds_a_bare_equals_stays_sealed(tmp_path):
    """A model name may hold `|=` (its namespace string still parses: the piece belongs to the model): the
    namespace is seen sealed, kept without its keyring, and erased with it."""
    kr = Keyring.init(tmp_path / "keys")
    hp, keys = _fill(tmp_path / "s", "alice", keyring=kr, model_name="org/M|=x")
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--yes")
    assert r.returncode == 1 and "sealed" in r.stdout, r.stdout
    assert _stored(tmp_path / "s", hp, keys, kr, model_name="org/M|=x") == 2
    r = _kvtier("erase", tmp_path / "s", "--tenant", "alice", "--keyring", tmp_path / "keys", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert kr.erased("alice") or Keyring(tmp_path / "keys").erased("alice")
