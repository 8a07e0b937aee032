//! Tenants and encryption at rest: tenant-scoped keys, AES-256-GCM sealing of stored objects with a key per
//! tenant derived from one master key, and stored names keyed by that master key (docs/SECURITY.md).
//!
//! **Tenant keys.** A tenant is named by its salt (the engine's `cache_salt`, or a deployment's), taken in
//! Unicode NFC (two spellings of one name are one tenant). Its page keys are `t<tag>.<mac>`: `tag` is 32 hex
//! digits (128 bits) of SHA-256 over the salt (what erasure finds a tenant's objects by), `mac` is
//! HMAC-SHA256 of the engine's own key under a key derived from the salt, so two tenants never share a key.
//! These are unkeyed functions of the salt: whoever guesses a salt computes them. A key without the prefix
//! belongs to no tenant (the default).
//!
//! **Keyring** ([`Keyring`]). A directory holding `master.key` and one key file per tenant. With a keyring,
//! a store or cluster tier never writes an engine's key or a tenant tag: it writes the keyed names of
//! [`Keyring::stored_name`] and [`Keyring::stored_tag`] (HMAC-SHA256 under a key derived from the master
//! key), so a reader of the disk who has no keyring can test no guessed prompt and no guessed salt.
//!
//! **Seal** ([`SealKey`]). Each object is encrypted under a key of its own, derived from its tenant's key
//! and the object's full name (namespace and key: an object moved to another name fails), with a fresh
//! random 96-bit nonce. Ciphertext has the plaintext's length, so stored objects keep their alignment; the
//! nonce, the 16-byte tag and the sealing key's id (the [`Seal`]) travel beside it.

mod files;
mod key;
mod keyring;

pub use key::{Seal, SealKey, SEAL_LEN};
pub use keyring::Keyring;

use ring::hmac;
use sha2::{Digest, Sha256};
use unicode_normalization::UnicodeNormalization;

use crate::error::{Error, Result};

/// Hex digits of a tenant tag (128 bits: no pair of salts with one tag can be searched for).
pub const TAG_HEX: usize = 32;

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// `salt` in Unicode NFC; an empty salt is refused.
fn normal_salt(salt: &str) -> Result<String> {
    if salt.is_empty() {
        return Err(Error::arg(
            "salt",
            "must be a non-empty string (None means no tenant)",
        ));
    }
    Ok(salt.nfc().collect())
}

/// The tenant tag of `salt`: 32 hex digits naming the tenant in its keys and erasure.
pub fn tenant_tag(salt: &str) -> Result<String> {
    let salt = normal_salt(salt)?;
    let d = Sha256::new()
        .chain_update(b"kvtier tenant tag v2\0")
        .chain_update(salt.as_bytes())
        .finalize();
    Ok(hex(&d[..TAG_HEX / 2]))
}

/// The tenant-scoped form of each of `keys` under `salt` (see the module docs).
pub fn tenant_keys(salt: &str, keys: &[String]) -> Result<Vec<String>> {
    let tag = tenant_tag(salt)?;
    let salt = normal_salt(salt)?;
    let secret = Sha256::new()
        .chain_update(b"kvtier tenant key\0")
        .chain_update(salt.as_bytes())
        .finalize();
    let mac = hmac::Key::new(hmac::HMAC_SHA256, &secret);
    Ok(keys
        .iter()
        .map(|k| format!("t{tag}.{}", hex(hmac::sign(&mac, k.as_bytes()).as_ref())))
        .collect())
}

/// The tenant tag a key or object name carries (`t<32 hex>.` prefix), if any.
pub fn tenant_of(key: &str) -> Option<&str> {
    let b = key.as_bytes();
    if b.len() > TAG_HEX + 1
        && b[0] == b't'
        && b[TAG_HEX + 1] == b'.'
        && valid_tag(&key[1..=TAG_HEX])
    {
        Some(&key[1..=TAG_HEX])
    } else {
        None
    }
}

/// Whether `tag` is a well-formed tenant tag (32 lowercase hex digits).
pub fn valid_tag(tag: &str) -> bool {
    tag.len() == TAG_HEX
        && tag
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_paths;
