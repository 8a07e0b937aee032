use super::*;

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
        assert_eq!(k.len(), 1 + 16 + 1 + 64);
    }
    assert_eq!(tenant_of(&format!("{}.k", a1[0])), Some(tag.as_str()));
    assert_eq!(tenant_of(&keys[0]), None);
    assert_eq!(tenant_of("t0123456789abcdefX"), None);
    assert_eq!(tenant_of("t0123456789ABCDEF.x"), None);
    assert!(tenant_keys("", &keys).is_err());
}

#[test]
fn seal_round_trips_and_rejects_any_change() {
    let (_d, ring) = ring_dir();
    let keys = ring.keys_for(&[None, Some("0123456789abcdef")], true);
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
    let other = keys[&Some("0123456789abcdef".to_owned())].clone().unwrap();
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
    let t = "00000000000000aa";
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
fn erasing_a_tenant_destroys_its_key_for_every_holder() {
    let (d, ring) = ring_dir();
    let t = "00000000000000bb";
    let k = ring.keys_for(&[Some(t)], true)[&Some(t.to_owned())]
        .clone()
        .unwrap();
    let mut buf = vec![9u8; 4096];
    let s = k.seal("x", &mut buf).unwrap();
    assert_eq!(ring.tenants(), vec![t.to_owned()]);
    // another process (another Keyring on the same directory) erases it
    let eraser = Keyring::open(d.path()).unwrap();
    assert!(eraser.erase_tenant(t).unwrap());
    assert!(!eraser.erase_tenant(t).unwrap());
    assert!(ring.tenants().is_empty());
    // the holder's next batch finds no key; a new write creates a new key that cannot open the old object
    assert!(ring.keys_for(&[Some(t)], false)[&Some(t.to_owned())].is_none());
    let fresh = ring.keys_for(&[Some(t)], true)[&Some(t.to_owned())]
        .clone()
        .unwrap();
    let mut b = buf.clone();
    assert!(!fresh.open("x", &mut b, &s));
    assert!(eraser.erase_tenant("nothex").is_err());
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
