//! Tenants and encryption at rest: tenant-scoped keys, and AES-256-GCM sealing of stored objects with a key
//! per tenant derived from one master key (docs/SECURITY.md).
//!
//! **Tenant keys.** A tenant is named by its salt (the engine's `cache_salt`, or a deployment's). Its page
//! keys are `t<tag>.<mac>`: `tag` is 16 hex digits of SHA-256 over the salt (what erasure finds a tenant's
//! objects by), `mac` is HMAC-SHA256 of the engine's own key under a key derived from the salt, so two tenants
//! never share a key and the stored names do not reveal the token hashes. A key without the prefix belongs
//! to no tenant (the default).
//!
//! **Keyring.** A directory holding `master.key` (32 random bytes as 64 hex digits, mode 0600) and
//! `tenants/<tag>.key` (32 random bytes per tenant, created at the tenant's first write). A tenant's sealing
//! key is HKDF-SHA256(salt = the tenant's random bytes, ikm = master, info = "kvtier seal v1 " ‖ tag); the
//! default tenant's has no random bytes. Deleting a tenant's file (erasure) leaves nothing from which its
//! key can be derived, even with the master key.
//!
//! **Seal.** Each object is encrypted with a fresh random 96-bit nonce and authenticated together with its
//! full object key as associated data (an object moved to another key fails). Ciphertext has the
//! plaintext's length, so stored objects keep their alignment; the nonce, the 16-byte tag and the sealing
//! key's id (the [`Seal`]) travel beside it (in the store's journal record, or a record object in the
//! cluster tier).

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};
use ring::rand::{SecureRandom, SystemRandom};
use ring::{hkdf, hmac};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Bytes of a [`Seal`]: a 12-byte nonce, the 16-byte tag, then the 4-byte id of the key that sealed it.
pub const SEAL_LEN: usize = 32;
/// The nonce, authentication tag and key id of one sealed object. The key id tells an object sealed under a
/// tenant key that was since destroyed (and replaced) from a damaged one without trying to open it.
pub type Seal = [u8; SEAL_LEN];
/// Hex digits of a tenant tag.
pub const TAG_HEX: usize = 16;

fn hex(b: &[u8]) -> String {
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

fn check_salt(salt: &str) -> Result<()> {
    if salt.is_empty() {
        return Err(Error::arg(
            "salt",
            "must be a non-empty string (None means no tenant)",
        ));
    }
    Ok(())
}

/// The tenant tag of `salt`: 16 hex digits naming the tenant in its keys and key file.
pub fn tenant_tag(salt: &str) -> Result<String> {
    check_salt(salt)?;
    let d = Sha256::new()
        .chain_update(b"kvtier tenant tag\0")
        .chain_update(salt.as_bytes())
        .finalize();
    Ok(hex(&d[..TAG_HEX / 2]))
}

/// The tenant-scoped form of each of `keys` under `salt` (see the module docs).
pub fn tenant_keys(salt: &str, keys: &[String]) -> Result<Vec<String>> {
    let tag = tenant_tag(salt)?;
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

/// The tenant tag a key or object name carries (`t<16 hex>.` prefix), if any.
pub fn tenant_of(key: &str) -> Option<&str> {
    let b = key.as_bytes();
    if b.len() > TAG_HEX + 1
        && b[0] == b't'
        && b[TAG_HEX + 1] == b'.'
        && b[1..=TAG_HEX]
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    {
        Some(&key[1..=TAG_HEX])
    } else {
        None
    }
}

/// Whether `tag` is a well-formed tenant tag (16 lowercase hex digits).
pub fn valid_tag(tag: &str) -> bool {
    tag.len() == TAG_HEX
        && tag
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

/// One tenant's sealing key.
pub struct SealKey {
    key: LessSafeKey,
    id: [u8; 4],
    rng: SystemRandom,
}

impl SealKey {
    fn derive(master: &[u8; 32], tenant: Option<(&str, &[u8; 32])>) -> Self {
        let (salt, tag) = match tenant {
            Some((tag, random)) => (&random[..], tag),
            None => (&[][..], "-"),
        };
        let info = format!("kvtier seal v1 {tag}");
        let info = [info.as_bytes()];
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(master);
        let okm = prk
            .expand(&info, &AES_256_GCM)
            .expect("HKDF output of one AES-256 key is within HKDF's limit");
        let d = Sha256::new()
            .chain_update(b"kvtier key id\0")
            .chain_update(master)
            .chain_update(tag.as_bytes())
            .chain_update(salt)
            .finalize();
        Self {
            key: LessSafeKey::new(UnboundKey::from(okm)),
            id: [d[0], d[1], d[2], d[3]],
            rng: SystemRandom::new(),
        }
    }

    /// The key's id (4 bytes as 8 hex digits): it changes when the tenant's key is destroyed and replaced.
    pub fn id_hex(&self) -> String {
        hex(&self.id)
    }

    /// Whether `seal` was made by this key (its key id; the tag alone decides whether the object opens).
    pub fn made(&self, seal: &Seal) -> bool {
        seal[28..] == self.id
    }

    /// Encrypts `buf` in place under a fresh nonce, authenticating `aad` with it; returns the seal.
    /// Fails only when the system's random source does.
    pub fn seal(&self, aad: &str, buf: &mut [u8]) -> Result<Seal> {
        let mut n = [0u8; 12];
        self.rng
            .fill(&mut n)
            .map_err(|_| Error::arg("keyring", "the system random source failed"))?;
        let tag = self
            .key
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
        self.key
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

/// A tenant's cached key and the random bytes of the file it came from (the file is read again at every
/// batch and compared, so an erasure by another process takes effect at the next batch, whatever file
/// replaced it).
type Cached = (Arc<SealKey>, [u8; 32]);

/// The keys of one deployment (see the module docs).
pub struct Keyring {
    dir: PathBuf,
    master: [u8; 32],
    id: String,
    default: Arc<SealKey>,
    tenants: Mutex<HashMap<String, Cached>>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keyring({:?}, id {})", self.dir, self.id) // never the key bytes
    }
}

fn io(what: impl Into<String>, e: std::io::Error) -> Error {
    Error::Os {
        what: what.into(),
        source: e,
    }
}

/// Creates `path` holding `bytes` (mode 0600) atomically: written and synced under a temporary name, then
/// linked into place, so no reader ever sees it partly written. Returns false (and changes nothing) if
/// `path` exists already.
fn create_secret(path: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut r = [0u8; 8];
    SystemRandom::new()
        .fill(&mut r)
        .map_err(|_| std::io::Error::other("the system random source failed"))?;
    let tmp = dir.join(format!(".tmp-{}-{}", std::process::id(), hex(&r)));
    let write = || -> std::io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    let linked = write().and_then(|()| match fs::hard_link(&tmp, path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    });
    let _ = fs::remove_file(&tmp);
    let linked = linked?;
    fs::File::open(dir)?.sync_all()?;
    Ok(linked)
}

impl Keyring {
    /// Creates a keyring directory with a new random master key. Refuses (changing nothing) a directory that
    /// exists and is not empty.
    pub fn init(dir: &Path) -> Result<()> {
        if let Ok(mut entries) = fs::read_dir(dir) {
            if entries.next().is_some() {
                return Err(Error::arg(
                    "keyring",
                    format!(
                        "{} exists and is not empty: a keyring is created in a new or empty directory, never over one",
                        dir.display()
                    ),
                ));
            }
        }
        fs::create_dir_all(dir.join("tenants"))
            .map_err(|e| io(format!("creating keyring {}", dir.display()), e))?;
        for d in [dir.to_path_buf(), dir.join("tenants")] {
            fs::set_permissions(&d, fs::Permissions::from_mode(0o700))
                .map_err(|e| io(format!("chmod 700 {}", d.display()), e))?;
        }
        let mut m = [0u8; 32];
        SystemRandom::new()
            .fill(&mut m)
            .map_err(|_| Error::arg("keyring", "the system random source failed"))?;
        let p = dir.join("master.key");
        match create_secret(&p, format!("{}\n", hex(&m)).as_bytes()) {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::arg(
                "keyring",
                format!(
                    "{} already exists: a keyring is never overwritten",
                    p.display()
                ),
            )),
            Err(e) => Err(io(format!("writing {}", p.display()), e)),
        }
    }

    /// Opens the keyring at `dir`. The master key must be 64 hex digits, readable by its owner only.
    pub fn open(dir: &Path) -> Result<Self> {
        let p = dir.join("master.key");
        let meta =
            fs::metadata(&p).map_err(|e| io(format!("keyring: reading {}", p.display()), e))?;
        if meta.mode() & 0o077 != 0 {
            return Err(Error::arg(
                "keyring",
                format!(
                    "{} is accessible by group or others (mode {:o}): chmod 600 it",
                    p.display(),
                    meta.mode() & 0o777
                ),
            ));
        }
        let text = fs::read_to_string(&p)
            .map_err(|e| io(format!("keyring: reading {}", p.display()), e))?;
        let master = unhex32(&text).ok_or_else(|| {
            Error::arg(
                "keyring",
                format!("{} must hold 64 hex digits (32 bytes)", p.display()),
            )
        })?;
        let id = hex(&Sha256::new()
            .chain_update(b"kvtier keyring id\0")
            .chain_update(master)
            .finalize()[..8]);
        Ok(Self {
            dir: dir.to_path_buf(),
            default: Arc::new(SealKey::derive(&master, None)),
            master,
            id,
            tenants: Mutex::new(HashMap::new()),
        })
    }

    /// 16 hex digits identifying the master key (not secret: it names the namespaces sealed with it).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The keyring's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn tenant_path(&self, tag: &str) -> PathBuf {
        self.dir.join("tenants").join(format!("{tag}.key"))
    }

    /// The sealing key of each tenant tag (`None`: the default tenant). With `create`, a tenant without a
    /// key file gets one; without it, such a tenant maps to `None` (its objects cannot be read). A key file
    /// that cannot be read or created also maps to `None`.
    pub fn keys_for(
        &self,
        tags: &[Option<&str>],
        create: bool,
    ) -> HashMap<Option<String>, Option<Arc<SealKey>>> {
        let mut out = HashMap::new();
        let mut cache = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
        for &t in tags {
            if out.contains_key(&t.map(str::to_owned)) {
                continue;
            }
            let k = match t {
                None => Some(self.default.clone()),
                Some(tag) => self.tenant_key(&mut cache, tag, create),
            };
            out.insert(t.map(str::to_owned), k);
        }
        out
    }

    fn tenant_key(
        &self,
        cache: &mut HashMap<String, Cached>,
        tag: &str,
        create: bool,
    ) -> Option<Arc<SealKey>> {
        if !valid_tag(tag) {
            return None;
        }
        let p = self.tenant_path(tag);
        // Ok(Some): a key; Ok(None): no file; Err(true): a file that does not parse; Err(false): unreadable now
        let read = || match fs::read_to_string(&p) {
            Ok(t) => unhex32(&t).map(Some).ok_or(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(_) => Err(false),
        };
        let random = match read() {
            Ok(Some(r)) => r,
            // unreadable for now (out of descriptors, an IO error): no key for this batch, nothing changed
            Err(false) => {
                cache.remove(tag);
                return None;
            }
            _ if !create => {
                cache.remove(tag); // missing (erased, or not here yet) or damaged: no key for now
                return None;
            }
            first => {
                // the tenant's first write here, or a key file that reads but does not parse (only damage
                // makes one: files are created whole and erased by a rename). Concurrent creators converge
                // on the one file that was linked.
                if first == Err(true) {
                    let _ = fs::remove_file(&p);
                }
                let mut r = [0u8; 32];
                SystemRandom::new().fill(&mut r).ok()?;
                create_secret(&p, format!("{}\n", hex(&r)).as_bytes()).ok()?;
                read().ok()??
            }
        };
        if let Some((k, was)) = cache.get(tag) {
            if *was == random {
                return Some(k.clone());
            }
        }
        let k = Arc::new(SealKey::derive(&self.master, Some((tag, &random))));
        cache.insert(tag.to_owned(), (k.clone(), random));
        Some(k)
    }

    /// Destroys tenant `tag`'s key: its file is renamed away (readers then find no key; a writer of the
    /// tenant makes a new one), overwritten, synced and removed, so nothing sealed under it can be opened again
    /// by anyone. Returns whether there was a key.
    pub fn erase_tenant(&self, tag: &str) -> Result<bool> {
        if !valid_tag(tag) {
            return Err(Error::arg(
                "tenant",
                format!("{tag:?} is not a tenant tag (16 lowercase hex digits)"),
            ));
        }
        self.tenants
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(tag);
        let p = self.tenant_path(tag);
        let mut r = [0u8; 8];
        SystemRandom::new()
            .fill(&mut r)
            .map_err(|_| Error::arg("keyring", "the system random source failed"))?;
        let gone = self
            .dir
            .join("tenants")
            .join(format!(".erased-{tag}-{}", hex(&r)));
        match fs::rename(&p, &gone) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io(format!("renaming {}", p.display()), e)),
        }
        let wipe = fs::OpenOptions::new()
            .write(true)
            .open(&gone)
            .and_then(|mut f| f.write_all(&[0u8; 65]).and_then(|()| f.sync_all()));
        let removed = fs::remove_file(&gone);
        fs::File::open(self.dir.join("tenants"))
            .and_then(|d| d.sync_all())
            .map_err(|e| io("syncing the keyring's tenants directory", e))?;
        wipe.and(removed)
            .map_err(|e| io(format!("destroying {}", gone.display()), e))?;
        Ok(true)
    }

    /// Tags of the tenants that have a key.
    pub fn tenants(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.dir.join("tenants"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_suffix(".key")
                    .map(str::to_owned)
            })
            .filter(|t| valid_tag(t))
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests;
