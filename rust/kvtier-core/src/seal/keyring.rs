//! The keys of one deployment: a master key, a key file per tenant, the tombstones of erased tenants, and
//! the keyed names stored objects carry (see the module docs of `crate::seal`).
//!
//! Layout: `master.key` (32 random bytes as 64 hex digits, mode 0600), `tenants/<stored tag>.key` (32 random
//! bytes per tenant, created at the tenant's first write) and `tenants/<stored tag>.erased` (a tombstone: the
//! tenant was erased and gets no key until an operator allows it again). A tenant's sealing key is
//! HKDF-SHA256(salt = the tenant's random bytes, ikm = master, info = "kvtier seal v2 " ‖ stored tag); the
//! default tenant's has no random bytes.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ring::rand::{SecureRandom, SystemRandom};
use ring::{hkdf, hmac};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::files::{self, check_dir, check_parent, create_secret, locate, read_secret, Unread};
use super::key::SealKey;
use super::{hex, tenant_of, unhex32, valid_tag, TAG_HEX};
use crate::error::{Error, Result};

/// A tenant's cached key and the random bytes of the file it came from (the file is read again at every
/// batch and compared, so an erasure by another process takes effect at the next batch, whatever file
/// replaced it).
type Cached = (Arc<SealKey>, Zeroizing<[u8; 32]>);

/// The keys of one deployment (see the module docs).
pub struct Keyring {
    dir: PathBuf,
    master: Zeroizing<[u8; 32]>,
    id: String,
    names: hmac::Key,
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

fn untrusted(why: String) -> Error {
    Error::arg("keyring", why)
}

fn random32() -> Result<Zeroizing<[u8; 32]>> {
    let mut r = Zeroizing::new([0u8; 32]);
    SystemRandom::new()
        .fill(&mut r[..])
        .map_err(|_| Error::arg("keyring", "the system random source failed"))?;
    Ok(r)
}

/// What [`Keyring::read_tenant`] found for a tenant.
enum TenantFile {
    Key(Zeroizing<[u8; 32]>),
    Missing,
    /// Something that is not a key: made by damage or planted (never trusted, replaced on a write).
    Bad,
    /// Unreadable for now (out of descriptors, an IO error): no key for this batch, nothing changed.
    Unreadable,
}

impl Keyring {
    /// Creates a keyring directory with a new random master key. Refuses (changing nothing) a directory that
    /// exists and is not empty, and any directory it could not trust afterwards (a link, another user's).
    pub fn init(dir: &Path) -> Result<()> {
        let dir = &locate(dir).map_err(|e| io(format!("keyring {}", dir.display()), e))?;
        check_parent(dir).map_err(untrusted)?;
        match fs::symlink_metadata(dir) {
            Ok(_) => {
                check_dir(dir).map_err(untrusted)?;
                let mut entries = fs::read_dir(dir)
                    .map_err(|e| io(format!("reading keyring {}", dir.display()), e))?;
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
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| io(format!("creating keyring {}", dir.display()), e))?;
            }
            Err(e) => return Err(io(format!("keyring {}", dir.display()), e)),
        }
        let tenants = dir.join("tenants");
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&tenants)
            .map_err(|e| io(format!("creating {}", tenants.display()), e))?;
        check_dir(&tenants).map_err(untrusted)?;
        let m = random32()?;
        let p = dir.join("master.key");
        let text = Zeroizing::new(format!("{}\n", hex(&m[..])));
        match create_secret(&p, text.as_bytes()) {
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

    /// Opens the keyring at `dir`: the directory and its `tenants/` must be this user's (or root's) and
    /// writable by nobody else, `master.key` a regular file of 64 hex digits that only its owner can access.
    pub fn open(dir: &Path) -> Result<Self> {
        let dir = &locate(dir).map_err(|e| io(format!("keyring {}", dir.display()), e))?;
        check_parent(dir).map_err(untrusted)?;
        check_dir(dir).map_err(untrusted)?;
        check_dir(&dir.join("tenants")).map_err(untrusted)?;
        let p = dir.join("master.key");
        let text = match read_secret(&p) {
            Ok(t) => t,
            Err(Unread::Missing) => {
                return Err(Error::arg(
                    "keyring",
                    format!("{} is missing: not a keyring", p.display()),
                ))
            }
            Err(Unread::Untrusted(why)) => return Err(untrusted(why)),
            Err(Unread::Io(e)) => return Err(io(format!("keyring: reading {}", p.display()), e)),
        };
        let master = std::str::from_utf8(&text)
            .ok()
            .and_then(unhex32)
            .map(Zeroizing::new)
            .ok_or_else(|| {
                Error::arg(
                    "keyring",
                    format!("{} must hold 64 hex digits (32 bytes)", p.display()),
                )
            })?;
        let id = hex(&Sha256::new()
            .chain_update(b"kvtier keyring id v2\0")
            .chain_update(&master[..])
            .finalize()[..8]);
        let mut nk = Zeroizing::new([0u8; 32]);
        hkdf::Salt::new(hkdf::HKDF_SHA256, b"kvtier names")
            .extract(&master[..])
            .expand(&[b"kvtier names v1"], hkdf::HKDF_SHA256)
            .and_then(|okm| okm.fill(&mut nk[..]))
            .expect("32 bytes of HKDF-SHA256 output are within HKDF's limit");
        let ring = Self {
            dir: dir.to_path_buf(),
            default: Arc::new(SealKey::derive(&master, None)),
            names: hmac::Key::new(hmac::HMAC_SHA256, &nk[..]),
            master,
            id,
            tenants: Mutex::new(HashMap::new()),
        };
        // a key an erasure renamed away and then could not destroy (it crashed, or the disk failed): best
        // effort here, and again at every erasure and allowance, which report a failure
        let _ = ring.destroy_renamed_keys();
        Ok(ring)
    }

    /// Destroys the key files an erasure renamed away and did not get to destroy (`.erased-*`).
    fn destroy_renamed_keys(&self) -> Result<()> {
        let dir = self.tenants_dir();
        let entries =
            fs::read_dir(&dir).map_err(|e| io(format!("reading {}", dir.display()), e))?;
        for e in entries.flatten() {
            // (a directory of that name is no key an erase left: not ours to remove, and no reason to fail)
            if e.file_name().to_string_lossy().starts_with(".erased-")
                && !e.file_type().is_ok_and(|t| t.is_dir())
            {
                let p = e.path();
                match files::wipe_and_remove(&p) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(io(format!("destroying {}", p.display()), e))
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// 16 hex digits identifying the master key (not secret: it names the namespaces sealed with it).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The keyring's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tag that tenant `tag` (a [`super::tenant_tag`]) has in stored names and in this keyring's files:
    /// a keyed function of it, so that no one without the master key can tell which salt it belongs to.
    pub fn stored_tag(&self, tag: &str) -> String {
        let d = hmac::sign(&self.names, format!("tag\0{tag}").as_bytes());
        hex(&d.as_ref()[..TAG_HEX / 2])
    }

    /// The name object `key` is stored under: `t<stored tag>.<mac>` for a tenant's key, `<mac>` otherwise,
    /// where `mac` is HMAC-SHA256 of the whole key under the keyring's name key (64 hex digits).
    pub fn stored_name(&self, key: &str) -> String {
        let mac = hex(hmac::sign(&self.names, format!("name\0{key}").as_bytes()).as_ref());
        match tenant_of(key) {
            Some(tag) => format!("t{}.{mac}", self.stored_tag(tag)),
            None => mac,
        }
    }

    fn tenants_dir(&self) -> PathBuf {
        self.dir.join("tenants")
    }

    fn key_path(&self, stag: &str) -> PathBuf {
        self.tenants_dir().join(format!("{stag}.key"))
    }

    fn tombstone_path(&self, stag: &str) -> PathBuf {
        self.tenants_dir().join(format!("{stag}.erased"))
    }

    /// Whether stored tag `stag` was erased (its tombstone is there; anything at that name counts, and an
    /// error looking counts too: a check that fails keeps the tenant erased).
    fn is_erased(&self, stag: &str) -> bool {
        !matches!(fs::symlink_metadata(self.tombstone_path(stag)), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
    }

    /// Whether `t`, given where a stored tag is expected, names an erased tenant: as a stored tag, or as the
    /// tenant's own tag (whose stored tag is tombstoned). Both spellings of a tenant are refused alike, so a
    /// caller that passes a tenant's tag unmapped gets no key for an erased tenant either.
    fn refused(&self, t: &str) -> bool {
        self.is_erased(t) || self.is_erased(&self.stored_tag(t))
    }

    fn read_tenant(&self, stag: &str) -> TenantFile {
        match read_secret(&self.key_path(stag)) {
            Ok(t) => match std::str::from_utf8(&t).ok().and_then(unhex32) {
                Some(r) => TenantFile::Key(Zeroizing::new(r)),
                None => TenantFile::Bad,
            },
            Err(Unread::Missing) => TenantFile::Missing,
            Err(Unread::Untrusted(_)) => TenantFile::Bad,
            Err(Unread::Io(_)) => TenantFile::Unreadable,
        }
    }

    /// The sealing key of each stored tenant tag (`None`: the default tenant). With `create`, a tenant
    /// without a key file gets one, unless it was erased; without it, such a tenant maps to `None` (its
    /// objects cannot be read). An erased tenant (given by its stored tag or by its own tag), and a key file
    /// that cannot be read or created, map to `None`.
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
                Some(stag) => {
                    let k = self.tenant_key(&mut cache, stag, create);
                    if k.is_none() {
                        cache.remove(stag);
                    }
                    k
                }
            };
            out.insert(t.map(str::to_owned), k);
        }
        out
    }

    fn tenant_key(
        &self,
        cache: &mut HashMap<String, Cached>,
        stag: &str,
        create: bool,
    ) -> Option<Arc<SealKey>> {
        if !valid_tag(stag) || self.refused(stag) {
            return None;
        }
        let random = match self.read_tenant(stag) {
            TenantFile::Key(r) => r,
            TenantFile::Unreadable => return None,
            TenantFile::Missing | TenantFile::Bad if !create => return None,
            found => {
                // the tenant's first write here, or a key file that is no key (damage, or something
                // planted: files are created whole and erased by a rename). Concurrent creators converge on
                // the one file that was linked.
                if matches!(found, TenantFile::Bad) {
                    let _ = fs::remove_file(self.key_path(stag)); // unlinks a link itself, never its target
                }
                let r = random32().ok()?;
                let text = Zeroizing::new(format!("{}\n", hex(&r[..])));
                create_secret(&self.key_path(stag), text.as_bytes()).ok()?;
                if self.refused(stag) {
                    return None; // erased while the key was being made: the tombstone wins
                }
                match self.read_tenant(stag) {
                    TenantFile::Key(r) => r,
                    _ => return None,
                }
            }
        };
        if let Some((k, was)) = cache.get(stag) {
            if **was == *random {
                return Some(k.clone());
            }
        }
        let k = Arc::new(SealKey::derive(&self.master, Some((stag, &random))));
        cache.insert(stag.to_owned(), (k.clone(), random));
        Some(k)
    }

    fn check_tag(tag: &str) -> Result<()> {
        if valid_tag(tag) {
            Ok(())
        } else {
            Err(Error::arg(
                "tenant",
                format!("{tag:?} is not a tenant tag ({TAG_HEX} lowercase hex digits)"),
            ))
        }
    }

    /// Erases tenant `tag` (a [`super::tenant_tag`]): first its tombstone is made, so that no process
    /// sharing this keyring gives the tenant a key again (its writes fail, its reads miss) until
    /// [`Keyring::allow_tenant`]; then its key file is renamed away, overwritten, synced and removed (and so is
    /// a key file named by the tenant's own tag, which a caller that passed the tag unmapped made).
    /// Returns whether there was a key.
    pub fn erase_tenant(&self, tag: &str) -> Result<bool> {
        Self::check_tag(tag)?;
        self.destroy_renamed_keys()?;
        let stag = self.stored_tag(tag);
        let tomb = self.tombstone_path(&stag);
        if !self.is_erased(&stag) {
            create_secret(&tomb, b"erased\n")
                .map_err(|e| io(format!("writing {}", tomb.display()), e))?;
        }
        {
            let mut cache = self.tenants.lock().unwrap_or_else(|p| p.into_inner());
            cache.remove(&stag);
            cache.remove(tag);
        }
        let mut had = false;
        for t in [stag.as_str(), tag] {
            had |= self.destroy_key(t)?;
        }
        Ok(had)
    }

    /// Renames the key file of `t` away, overwrites, syncs and removes it; whether there was one.
    fn destroy_key(&self, t: &str) -> Result<bool> {
        let p = self.key_path(t);
        let mut r = [0u8; 8];
        SystemRandom::new()
            .fill(&mut r)
            .map_err(|_| Error::arg("keyring", "the system random source failed"))?;
        let gone = self.tenants_dir().join(format!(".erased-{t}-{}", hex(&r)));
        match fs::rename(&p, &gone) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io(format!("renaming {}", p.display()), e)),
        }
        let wiped = files::wipe_and_remove(&gone);
        fs::File::open(self.tenants_dir())
            .and_then(|d| d.sync_all())
            .map_err(|e| io("syncing the keyring's tenants directory", e))?;
        match wiped {
            // another process's sweep (`destroy_renamed_keys`) destroyed it first
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            w => w.map_err(|e| io(format!("destroying {}", gone.display()), e))?,
        }
        Ok(true)
    }

    /// Lets erased tenant `tag` have a key again (its next write makes a new one; nothing sealed before the
    /// erasure opens). Returns whether it was erased.
    pub fn allow_tenant(&self, tag: &str) -> Result<bool> {
        Self::check_tag(tag)?;
        self.destroy_renamed_keys()?;
        let stag = self.stored_tag(tag);
        if !self.is_erased(&stag) {
            return Ok(false);
        }
        // a key a writer made while the tenant was being erased must not come back with it
        for key in [self.key_path(&stag), self.key_path(tag)] {
            if fs::symlink_metadata(&key).is_ok() {
                files::wipe_and_remove(&key)
                    .map_err(|e| io(format!("removing {}", key.display()), e))?;
            }
        }
        let tomb = self.tombstone_path(&stag);
        fs::remove_file(&tomb).map_err(|e| io(format!("removing {}", tomb.display()), e))?;
        fs::File::open(self.tenants_dir())
            .and_then(|d| d.sync_all())
            .map_err(|e| io("syncing the keyring's tenants directory", e))?;
        Ok(true)
    }

    /// Whether tenant `tag` (a [`super::tenant_tag`]) is erased in this keyring.
    pub fn erased(&self, tag: &str) -> Result<bool> {
        Self::check_tag(tag)?;
        Ok(self.is_erased(&self.stored_tag(tag)))
    }

    /// Whether tenant `tag` (a [`super::tenant_tag`]) has a key file here (named by its stored tag, or by
    /// its own tag: see [`Keyring::erase_tenant`]).
    pub fn has_key(&self, tag: &str) -> Result<bool> {
        Self::check_tag(tag)?;
        Ok([self.key_path(&self.stored_tag(tag)), self.key_path(tag)]
            .iter()
            .any(|p| fs::symlink_metadata(p).is_ok()))
    }

    fn listed(&self, suffix: &str) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.tenants_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_suffix(suffix)
                    .map(str::to_owned)
            })
            .filter(|t| valid_tag(t))
            .collect();
        v.sort();
        v
    }

    /// Stored tags of the tenants that have a key (keyed: they do not show which tenant they are).
    pub fn tenants(&self) -> Vec<String> {
        self.listed(".key")
    }

    /// Stored tags of the erased tenants.
    pub fn erased_tenants(&self) -> Vec<String> {
        self.listed(".erased")
    }
}
