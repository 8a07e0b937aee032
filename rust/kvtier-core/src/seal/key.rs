//! One tenant's sealing key, and the key of each object under it.

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use crate::error::{Error, Result};

/// Bytes of a [`Seal`]: a 12-byte nonce, the 16-byte tag, then the 4-byte id of the key that sealed it.
pub const SEAL_LEN: usize = 32;
/// The nonce, authentication tag and key id of one sealed object. The key id tells an object sealed under a
/// tenant key that was since destroyed (and replaced) from a damaged one without trying to open it.
pub type Seal = [u8; SEAL_LEN];

/// HKDF output of `n` bytes.
struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// One tenant's sealing key: a pseudo-random key from which each object's AES-256-GCM key is derived with
/// the object's full name (its namespace and key). A random 96-bit nonce then only has to be unique among
/// the seals of one name under one tenant key (its rewrites), not among every object of the tenant: NIST
/// SP 800-38D's 2^32 invocations per key would take 2^32 rewrites of one name.
pub struct SealKey {
    prk: hkdf::Prk,
    id: [u8; 4],
    rng: SystemRandom,
}

impl SealKey {
    /// The key of tenant `(tag, its random bytes)`, or the default tenant's (`None`), under `master`.
    pub(super) fn derive(master: &[u8; 32], tenant: Option<(&str, &[u8; 32])>) -> Self {
        let (salt, tag) = match tenant {
            Some((tag, random)) => (&random[..], tag),
            None => (&[][..], "-"),
        };
        let info = format!("kvtier seal v2 {tag}");
        let info = [info.as_bytes()];
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(master);
        let mut bytes = Zeroizing::new([0u8; 32]);
        prk.expand(&info, Len(32))
            .and_then(|okm| okm.fill(&mut bytes[..]))
            .expect("32 bytes of HKDF-SHA256 output are within HKDF's limit");
        let d = Sha256::new()
            .chain_update(b"kvtier key id v2\0")
            .chain_update(master)
            .chain_update(tag.as_bytes())
            .chain_update(salt)
            .finalize();
        Self {
            prk: hkdf::Prk::new_less_safe(hkdf::HKDF_SHA256, &bytes[..]),
            id: [d[0], d[1], d[2], d[3]],
            rng: SystemRandom::new(),
        }
    }

    /// The AES-256-GCM key of the object named `aad`.
    fn object_key(&self, aad: &str) -> LessSafeKey {
        let info = [b"kvtier object\0".as_slice(), aad.as_bytes()];
        let okm = self
            .prk
            .expand(&info, &AES_256_GCM)
            .expect("one AES-256 key of HKDF-SHA256 output is within HKDF's limit");
        LessSafeKey::new(UnboundKey::from(okm))
    }

    /// The key's id (4 bytes as 8 hex digits): it changes when the tenant's key is destroyed and replaced.
    pub fn id_hex(&self) -> String {
        super::hex(&self.id)
    }

    /// Whether `seal` was made by this key (its key id; the tag alone decides whether the object opens).
    pub fn made(&self, seal: &Seal) -> bool {
        seal[28..] == self.id
    }

    /// Encrypts `buf` in place under the key of the object named `aad` and a fresh nonce, authenticating
    /// `aad` with it; returns the seal. Fails only when the system's random source does.
    pub fn seal(&self, aad: &str, buf: &mut [u8]) -> Result<Seal> {
        let mut n = [0u8; 12];
        self.rng
            .fill(&mut n)
            .map_err(|_| Error::arg("keyring", "the system random source failed"))?;
        let tag = self
            .object_key(aad)
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(n),
                Aad::from(aad.as_bytes()),
                buf,
            )
            .map_err(|_| Error::arg("object", "too long for AES-GCM"))?;
        let mut s = [0u8; SEAL_LEN];
        s[..12].copy_from_slice(&n);
        s[12..28].copy_from_slice(tag.as_ref());
        s[28..].copy_from_slice(&self.id);
        Ok(s)
    }

    /// Decrypts `buf` in place; false (and `buf` unspecified) unless the seal is this key's and the tag
    /// authenticates `buf` and `aad`.
    pub fn open(&self, aad: &str, buf: &mut [u8], seal: &Seal) -> bool {
        if !self.made(seal) {
            return false;
        }
        let mut n = [0u8; 12];
        n.copy_from_slice(&seal[..12]);
        let mut t = [0u8; 16];
        t.copy_from_slice(&seal[12..28]);
        self.object_key(aad)
            .open_in_place_separate_tag(
                Nonce::assume_unique_for_key(n),
                Aad::from(aad.as_bytes()),
                Tag::from(t),
                buf,
                0..,
            )
            .is_ok()
    }
}
