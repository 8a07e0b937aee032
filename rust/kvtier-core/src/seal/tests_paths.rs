//! Where a keyring is: a path with a trailing `/` or `.` names the link, not its target; a relative path is
//! fixed when the keyring is opened; a key an erasure renamed away and could not destroy is destroyed later.

use super::*;

/// A fresh directory under the system's temporary one, removed on drop.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(what: &str) -> Self {
        let p =
            std::env::temp_dir().join(format!("kvtier-ring-paths-{}-{what}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_link_to_a_keyring_is_refused_with_a_trailing_slash_or_dot_too() {
    let s = Scratch::new("link");
    let real = s.0.join("keys");
    Keyring::init(&real).unwrap();
    let link = s.0.join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    for spelling in ["link", "link/", "link/.", "link//", "./link/./"] {
        let p = s.0.join(spelling);
        let e = Keyring::open(&p).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{spelling}: {e}");
    }
    let other = s.0.join("made-through-a-link");
    std::os::unix::fs::symlink(s.0.join("nowhere"), &other).unwrap();
    assert!(Keyring::init(&s.0.join("made-through-a-link/")).is_err());
    assert!(!s.0.join("nowhere").exists(), "init followed the link");
    // the directory itself opens, however it is spelled
    for spelling in ["keys", "keys/", "keys/.", "link/../keys"] {
        Keyring::open(&s.0.join(spelling)).unwrap();
    }
}

#[test]
fn a_relative_keyring_path_is_fixed_when_it_is_opened() {
    let s = Scratch::new("relative");
    Keyring::init(&s.0.join("keys")).unwrap();
    let cwd = std::env::current_dir().unwrap();
    let up = "../".repeat(cwd.components().count());
    let rel = std::path::PathBuf::from(up).join(s.0.strip_prefix("/").unwrap().join("keys"));
    assert!(rel.is_relative());
    let kr = Keyring::open(&rel).unwrap();
    assert!(kr.dir().is_absolute(), "{}", kr.dir().display());
    assert_eq!(kr.dir(), std::fs::canonicalize(s.0.join("keys")).unwrap());
}

#[test]
fn a_key_an_erasure_renamed_away_and_never_destroyed_is_destroyed_later() {
    let s = Scratch::new("renamed");
    let dir = s.0.join("keys");
    Keyring::init(&dir).unwrap();
    let kr = Keyring::open(&dir).unwrap();
    let tag = tenant_tag("alice").unwrap();
    let stag = kr.stored_tag(&tag);
    let keys = kr.keys_for(&[Some(stag.as_str())], true);
    assert!(keys[&Some(stag.clone())].is_some());
    let tenants = dir.join("tenants");
    // an erasure that crashed between its rename and its wipe left the key under another name
    let left = tenants.join(format!(".erased-{stag}-00112233aabbccdd"));
    std::fs::rename(tenants.join(format!("{stag}.key")), &left).unwrap();
    drop(kr);
    let kr = Keyring::open(&dir).unwrap();
    assert!(!left.exists(), "the renamed key survived an open");
    // and an erasure or allowance sweeps one that appears while the keyring is open
    std::fs::write(&left, b"0".repeat(64)).unwrap();
    kr.erase_tenant(T_OTHER).unwrap();
    assert!(!left.exists(), "the renamed key survived an erasure");
    std::fs::write(&left, b"0".repeat(64)).unwrap();
    kr.allow_tenant(T_OTHER).unwrap();
    assert!(!left.exists(), "the renamed key survived an allowance");
}

const T_OTHER: &str = "000000000000000000000000000000cc";

/// A tenant key file that is a hard link to another file: erasing the tenant removes the name and leaves
/// the other file's bytes as they were (the overwrite never lands in a file the key shares its bytes with).
#[test]
fn erasing_a_key_that_is_a_hard_link_leaves_the_linked_file_alone() {
    let s = Scratch::new("hardlink");
    let dir = s.0.join("keys");
    Keyring::init(&dir).unwrap();
    let kr = Keyring::open(&dir).unwrap();
    let tag = tenant_tag("alice").unwrap();
    let stag = kr.stored_tag(&tag);
    let victim = s.0.join("victim");
    std::fs::write(&victim, b"precious bytes").unwrap();
    let key = dir.join("tenants").join(format!("{stag}.key"));
    std::fs::hard_link(&victim, &key).unwrap();
    kr.erase_tenant(&tag).unwrap();
    assert!(!key.exists());
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious bytes");
}

/// A directory named like a key an erasure renamed away is no such key: erasures and allowances go on.
#[test]
fn a_directory_named_like_a_renamed_key_blocks_nothing() {
    let s = Scratch::new("erased-dir");
    let dir = s.0.join("keys");
    Keyring::init(&dir).unwrap();
    let odd = dir.join("tenants").join(".erased-x");
    std::fs::create_dir(&odd).unwrap();
    let kr = Keyring::open(&dir).unwrap();
    kr.erase_tenant(T_OTHER).unwrap();
    assert!(kr.erased(T_OTHER).unwrap());
    kr.allow_tenant(T_OTHER).unwrap();
    assert!(!kr.erased(T_OTHER).unwrap() && odd.is_dir());
}
