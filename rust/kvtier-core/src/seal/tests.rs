use super::*;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::sync::Arc;

const T1: &str = "0123456789abcdef0123456789abcdef";
const T2: &str = "000000000000000000000000000000aa";
const T3: &str = "000000000000000000000000000000bb";

fn ring_dir() -> (tempdir::Dir, Keyring) {
    let d = tempdir::Dir::new();
    Keyring::init(d.path()).unwrap();
    let k = Keyring::open(d.path()).unwrap();
    (d, k)
}

mod tempdir {
    /// A temporary directory removed on drop.
    pub struct Dir(std::path::PathBuf);
    impl Dir {
        pub fn new() -> Self {
            static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!("kvtier-seal-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            Self(p)
        }
        pub fn path(&self) -> &std::path::Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn tenant_keys_are_deterministic_distinct_and_carry_their_tag() {
    let keys = vec!["a".repeat(64), "b".repeat(64)];
    let a1 = tenant_keys("alice", &keys).unwrap();
    let a2 = tenant_keys("alice", &keys).unwrap();
    let b = tenant_keys("bob", &keys).unwrap();
    assert_eq!(a1, a2);
    assert_ne!(a1[0], b[0]);
    assert_ne!(a1[0], a1[1]);
    let tag = tenant_tag("alice").unwrap();
    for k in &a1 {
        assert_eq!(tenant_of(k), Some(tag.as_str()));
        assert!(
            !k.contains(&keys[0]),
            "the engine's key must not show through"
        );
        assert_eq!(k.len(), 1 + 32 + 1 + 64);
    }
    assert_eq!(tenant_of(&format!("{}.k", a1[0])), Some(tag.as_str()));
    assert_eq!(tenant_of(&keys[0]), None);
    assert_eq!(tenant_of("t0123456789abcdef0123456789abcdefX"), None);
    assert_eq!(tenant_of("t0123456789ABCDEF0123456789abcdef.x"), None);
    assert_eq!(tenant_of("t0123456789abcdef.x"), None); // the short tags of format 1 are no tenant
    assert_eq!(tenant_of("t0123456789abcdef0123456789abcd\u{e9}.x"), None);
    assert!(tenant_keys("", &keys).is_err());
}

#[test]
fn seal_round_trips_and_rejects_any_change() {
    let (_d, ring) = ring_dir();
    let keys = ring.keys_for(&[None, Some(T1)], true);
    let k = keys[&None].clone().unwrap();
    let plain: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
    let mut buf = plain.clone();
    let s = k.seal("key.k", &mut buf).unwrap();
    assert_ne!(buf, plain);
    let mut b2 = buf.clone();
    assert!(k.open("key.k", &mut b2, &s));
    assert_eq!(b2, plain);
    // another object name, a flipped byte, a flipped tag bit, another tenant's key: all refused
    let mut b3 = buf.clone();
    assert!(!k.open("key.v", &mut b3, &s));
    let mut b4 = buf.clone();
    b4[4000] ^= 1;
    assert!(!k.open("key.k", &mut b4, &s));
    let mut s2 = s;
    s2[27] ^= 0x80;
    let mut b5 = buf.clone();
    assert!(!k.open("key.k", &mut b5, &s2));
    let other = keys[&Some(T1.to_owned())].clone().unwrap();
    let mut b6 = buf.clone();
    assert!(!other.open("key.k", &mut b6, &s));
    // a fresh nonce per seal: sealing the same bytes twice gives different ciphertexts
    let mut again = plain.clone();
    let s3 = k.seal("key.k", &mut again).unwrap();
    assert_ne!(s3[..12], s[..12]);
    assert_ne!(again, buf);
}

#[test]
fn keys_survive_reopen_and_another_master_cannot_open() {
    let (d, ring) = ring_dir();
    let t = T2;
    let k = ring.keys_for(&[Some(t)], true)[&Some(t.to_owned())]
        .clone()
        .unwrap();
    let mut buf = vec![5u8; 4096];
    let s = k.seal("x", &mut buf).unwrap();
    let again = Keyring::open(d.path()).unwrap();
    let k2 = again.keys_for(&[Some(t)], false)[&Some(t.to_owned())]
        .clone()
        .unwrap();
    let mut b = buf.clone();
    assert!(k2.open("x", &mut b, &s));
    let (_e, other) = ring_dir();
    assert_ne!(other.id(), ring.id());
    // the other ring has no file for the tenant: no key without `create`, a different key with it
    assert!(other.keys_for(&[Some(t)], false)[&Some(t.to_owned())].is_none());
    let k3 = other.keys_for(&[Some(t)], true)[&Some(t.to_owned())]
        .clone()
        .unwrap();
    let mut b = buf.clone();
    assert!(!k3.open("x", &mut b, &s));
}

#[test]
fn erasing_a_tenant_destroys_its_key_for_every_holder_and_keeps_it_erased() {
    let (d, ring) = ring_dir();
    let t = T3;
    let st = ring.stored_tag(t);
    let k = ring.keys_for(&[Some(&st)], true)[&Some(st.clone())]
        .clone()
        .unwrap();
    let mut buf = vec![9u8; 4096];
    let s = k.seal("x", &mut buf).unwrap();
    assert_eq!(ring.tenants(), vec![st.clone()]);
    // another process (another Keyring on the same directory) erases it
    let eraser = Keyring::open(d.path()).unwrap();
    assert!(eraser.erase_tenant(t).unwrap());
    assert!(!eraser.erase_tenant(t).unwrap());
    assert!(ring.tenants().is_empty());
    assert_eq!(ring.erased_tenants(), vec![st.clone()]);
    assert!(ring.erased(t).unwrap());
    // the holder's next batch finds no key, and a write makes none: the tenant stays erased
    assert!(ring.keys_for(&[Some(&st)], false)[&Some(st.clone())].is_none());
    assert!(ring.keys_for(&[Some(&st)], true)[&Some(st.clone())].is_none());
    assert!(!ring.has_key(t).unwrap());
    // a key file that appears anyway (a writer racing the erasure) is never used
    files::create_secret(
        &d.path().join("tenants").join(format!("{st}.key")),
        format!("{}\n", "ab".repeat(32)).as_bytes(),
    )
    .unwrap();
    assert!(ring.keys_for(&[Some(&st)], true)[&Some(st.clone())].is_none());
    // until an operator allows it: then a new key, which cannot open what was sealed before
    assert!(eraser.allow_tenant(t).unwrap());
    assert!(!eraser.allow_tenant(t).unwrap());
    assert!(
        !ring.has_key(t).unwrap(),
        "the racing writer's key went with the tombstone"
    );
    let fresh = ring.keys_for(&[Some(&st)], true)[&Some(st.clone())]
        .clone()
        .unwrap();
    let mut b = buf.clone();
    assert!(!fresh.open("x", &mut b, &s));
    assert!(eraser.erase_tenant("nothex").is_err());
    assert!(
        eraser.erase_tenant("0123456789abcdef").is_err(),
        "a short tag is no tag"
    );
}

#[test]
fn a_keyring_is_never_overwritten_and_must_be_private() {
    let (d, ring) = ring_dir();
    let id = ring.id().to_owned();
    assert!(Keyring::init(d.path()).is_err());
    assert_eq!(Keyring::open(d.path()).unwrap().id(), id);
    let p = d.path().join("master.key");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = Keyring::open(d.path()).unwrap_err().to_string();
    assert!(e.contains("accessible by group or others"), "{e}");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(&p, "short\n").unwrap();
    assert!(Keyring::open(d.path())
        .unwrap_err()
        .to_string()
        .contains("64 hex digits"));
    assert!(Keyring::open(&d.path().join("missing")).is_err());
    assert!(!format!("{ring:?}").contains(&std::fs::read_to_string(&p).unwrap()));
}

#[test]
fn salts_are_nfc_and_tags_are_128_bits() {
    // "é" precomposed and as e + combining acute: one tenant
    let a = tenant_tag("caf\u{e9}").unwrap();
    let b = tenant_tag("cafe\u{301}").unwrap();
    assert_eq!(a, b);
    assert_eq!(a.len(), 32);
    let k = vec!["x".to_owned()];
    assert_eq!(
        tenant_keys("caf\u{e9}", &k).unwrap(),
        tenant_keys("cafe\u{301}", &k).unwrap()
    );
    assert_ne!(tenant_tag("cafe").unwrap(), a);
}

#[test]
fn stored_names_show_no_key_no_tag_and_depend_on_the_master_key() {
    let (_d, ring) = ring_dir();
    let (_e, other) = ring_dir();
    let engine_key = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let salted = tenant_keys("user-48213", &[engine_key.to_owned()]).unwrap();
    let tag = tenant_tag("user-48213").unwrap();
    for key in [
        engine_key.to_owned(),
        salted[0].clone(),
        format!("{}.k", salted[0]),
    ] {
        let n = ring.stored_name(&key);
        assert!(!n.contains(engine_key) && !n.contains(&tag), "{n}");
        assert_eq!(n, ring.stored_name(&key), "deterministic");
        assert_ne!(n, other.stored_name(&key), "keyed by the master key");
    }
    let n = ring.stored_name(&salted[0]);
    let st = ring.stored_tag(&tag);
    assert_eq!(
        tenant_of(&n),
        Some(st.as_str()),
        "a tenant's names carry its stored tag"
    );
    assert_ne!(st, other.stored_tag(&tag));
    assert_eq!(tenant_of(&ring.stored_name(engine_key)), None);
    assert_ne!(
        ring.stored_name(&format!("{}.k", salted[0])),
        ring.stored_name(&format!("{}.v", salted[0]))
    );
}

#[test]
fn each_object_has_its_own_key_so_nonces_only_meet_within_one_name() {
    let (_d, ring) = ring_dir();
    let k = ring.keys_for(&[None], true)[&None].clone().unwrap();
    // the same nonce and plaintext under two names: different ciphertexts (different keys)
    let plain = vec![0u8; 4096];
    let (mut a, mut b) = (plain.clone(), plain.clone());
    let sa = k.seal("ns\0a", &mut a).unwrap();
    let mut sb = sa;
    let key_b = k.seal("ns\0b", &mut b).unwrap();
    assert_ne!(a, b);
    // an object's seal does not open another name's bytes even with its nonce copied over
    sb[..12].copy_from_slice(&key_b[..12]);
    let mut a2 = a.clone();
    assert!(!k.open("ns\0b", &mut a2, &sa));
}

#[cfg(test)]
fn chown(p: &std::path::Path, uid: u32) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that lives through the call; lchown touches no memory of ours.
    assert_eq!(unsafe { libc::lchown(c.as_ptr(), uid, u32::MAX) }, 0);
}

#[cfg(test)]
fn is_root() -> bool {
    // SAFETY: geteuid takes no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn a_keyring_another_user_could_have_planted_is_refused() {
    // a symbolic link for the directory
    let (d, _ring) = ring_dir();
    let link = d.path().with_extension("link");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(d.path(), &link).unwrap();
    let e = Keyring::open(&link).unwrap_err().to_string();
    assert!(e.contains("symbolic link"), "{e}");
    assert!(Keyring::init(&link).is_err());
    std::fs::remove_file(&link).unwrap();
    // a directory group or others can write
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = Keyring::open(d.path()).unwrap_err().to_string();
    assert!(e.contains("writable by group or others"), "{e}");
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    // master.key as a symbolic link to a key file elsewhere
    let p = d.path().join("master.key");
    let elsewhere = d.path().with_extension("key");
    std::fs::copy(&p, &elsewhere).unwrap();
    std::fs::remove_file(&p).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &p).unwrap();
    let e = Keyring::open(d.path()).unwrap_err().to_string();
    assert!(e.contains("symbolic link"), "{e}");
    std::fs::remove_file(&p).unwrap();
    std::fs::rename(&elsewhere, &p).unwrap();
    Keyring::open(d.path()).unwrap();
    if is_root() {
        // another user's master.key, tenants/ or keyring directory
        chown(&p, 65534);
        let e = Keyring::open(d.path()).unwrap_err().to_string();
        assert!(e.contains("owned by uid 65534"), "{e}");
        chown(&p, 0);
        chown(&d.path().join("tenants"), 65534);
        assert!(Keyring::open(d.path()).is_err());
        chown(&d.path().join("tenants"), 0);
        chown(d.path(), 65534);
        assert!(Keyring::open(d.path()).is_err());
        assert!(Keyring::init(d.path()).is_err());
        chown(d.path(), 0);
        // an empty directory pre-created by another user is never made a keyring
        let (e2, _) = (tempdir::Dir::new(), ());
        std::fs::create_dir(e2.path()).unwrap();
        std::fs::set_permissions(e2.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        chown(e2.path(), 65534);
        let e = Keyring::init(e2.path()).unwrap_err().to_string();
        assert!(e.contains("owned by uid 65534"), "{e}");
        assert!(!e2.path().join("master.key").exists());
    }
}

#[test]
fn tenant_key_files_that_are_no_key_are_never_read_or_followed() {
    let (d, ring) = ring_dir();
    let st = ring.stored_tag(T1);
    let kp = d.path().join("tenants").join(format!("{st}.key"));
    // a FIFO: a lookup returns at once with no key (it never blocks on it); a write replaces it
    let c = std::ffi::CString::new(kp.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that lives through the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    assert!(ring.keys_for(&[Some(&st)], false)[&Some(st.clone())].is_none());
    assert!(ring.keys_for(&[Some(&st)], true)[&Some(st.clone())].is_some());
    // a huge file: not read whole, not a key
    std::fs::remove_file(&kp).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&kp)
        .unwrap();
    f.set_len(256 << 20).unwrap();
    assert!(matches!(
        files::read_secret(&kp),
        Err(files::Unread::Untrusted(_))
    ));
    assert!(ring.keys_for(&[Some(&st)], false)[&Some(st.clone())].is_none());
    std::fs::remove_file(&kp).unwrap();
    // a symbolic link to a file elsewhere: erasing the tenant removes the link and never writes the target
    let victim = d.path().with_extension("victim");
    std::fs::write(&victim, b"precious").unwrap();
    std::os::unix::fs::symlink(&victim, &kp).unwrap();
    assert!(ring.keys_for(&[Some(&st)], false)[&Some(st.clone())].is_none());
    assert!(ring.erase_tenant(T1).unwrap());
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(std::fs::symlink_metadata(&kp).is_err());
    std::fs::remove_file(&victim).unwrap();
}

#[test]
fn an_erased_tenant_gets_no_key_by_its_stored_tag_nor_by_its_own() {
    let (d, ring) = ring_dir();
    let st = ring.stored_tag(T1);
    let tenants = d.path().join("tenants");
    let key_file = |t: &str| tenants.join(format!("{t}.key"));
    // a key under the stored tag, and one under the tenant's own tag (a caller that passed it unmapped)
    for t in [st.as_str(), T1] {
        assert!(ring.keys_for(&[Some(t)], true)[&Some(t.to_owned())].is_some());
        assert!(key_file(t).exists());
    }
    assert!(ring.erase_tenant(T1).unwrap());
    assert!(
        !key_file(&st).exists() && !key_file(T1).exists(),
        "both key files destroyed"
    );
    assert!(!ring.has_key(T1).unwrap());
    // every holder, every spelling, reading or writing: no key, and no key file made
    let other = Keyring::open(d.path()).unwrap();
    for r in [&ring, &other] {
        for t in [st.as_str(), T1] {
            for create in [false, true] {
                let k = r.keys_for(&[Some(t)], create);
                assert!(k[&Some(t.to_owned())].is_none(), "{t} create={create}");
            }
        }
    }
    assert!(!key_file(&st).exists() && !key_file(T1).exists());
    // the batch paths (the cluster tier's): seal_into seals nothing, open_in_place opens nothing
    let ranges = crate::ranges::Ranges::default();
    let region = Arc::new(crate::buffer::HostRegion::new(8192, &Default::default()).unwrap());
    ranges.register_region(region.clone());
    let (src, dst) = (region.as_ptr() as usize, region.as_ptr() as usize + 4096);
    let objs = [("x", src, 4096u64)];
    for t in [st.as_str(), T1] {
        let sealed = ranges.seal_into(&ring, &objs, &[Some(t)], &[dst]).unwrap();
        assert!(sealed[0].is_none(), "{t}");
        let opened = ranges
            .open_in_place(&ring, &objs, &[Some(t)], &[[0u8; SEAL_LEN]])
            .unwrap();
        assert!(!opened[0], "{t}");
    }
    // the default tenant still seals
    assert!(ranges.seal_into(&ring, &objs, &[None], &[dst]).unwrap()[0].is_some());
    // allowed again: a key under either spelling is fresh (the one made before the erasure is gone)
    assert!(ring.allow_tenant(T1).unwrap());
    assert!(ring.keys_for(&[Some(T1)], true)[&Some(T1.to_owned())].is_some());
}
