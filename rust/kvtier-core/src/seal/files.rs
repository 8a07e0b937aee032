//! The keyring's files, read and written without trusting anything another user could have made: a
//! directory another user owns or can write, a symbolic link, a FIFO, a file of the wrong owner, mode or
//! size (SQLite's and OpenSSH's habits: check what was opened, never the path before opening it).

use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use ring::rand::{SecureRandom, SystemRandom};
use zeroize::Zeroizing;

use super::hex;

/// The longest key file kvtier reads (64 hex digits and a newline fit many times over).
const MAX_SECRET: u64 = 256;

fn euid() -> u32 {
    // SAFETY: geteuid takes no arguments, touches no memory of ours and cannot fail.
    unsafe { libc::geteuid() }
}

/// Owners whose files the keyring trusts: the process's own user, and root (who could replace it anyway).
fn trusted_owner(uid: u32) -> bool {
    uid == euid() || uid == 0
}

/// Why the keyring directory (or its `tenants/`) at `p` cannot be trusted, if it cannot: a symbolic link,
/// not a directory, owned by another user, or writable by group or others.
/// The keyring directory `p` names, made absolute (a later `chdir` does not move it) and without trailing
/// `/` or `.` (`link/` and `link/.` would make `lstat` follow the link): its parent resolved, its own name
/// kept, so a symbolic link there is seen and refused.
pub(super) fn locate(p: &Path) -> io::Result<PathBuf> {
    let abs = std::path::absolute(p)?;
    let clean: PathBuf = abs.components().collect();
    match (clean.parent(), clean.components().next_back()) {
        (Some(parent), Some(Component::Normal(name))) => {
            let parent = if parent.as_os_str().is_empty() {
                PathBuf::from("/")
            } else {
                parent.to_path_buf()
            };
            Ok(fs::canonicalize(&parent).unwrap_or(parent).join(name))
        }
        // `/` or a path ending in `..`: the directory it resolves to
        _ => fs::canonicalize(&clean),
    }
}

pub(super) fn check_dir(p: &Path) -> std::result::Result<(), String> {
    let m = fs::symlink_metadata(p).map_err(|e| format!("{}: {e}", p.display()))?;
    if m.file_type().is_symlink() {
        return Err(format!(
            "{} is a symbolic link: give the keyring directory itself",
            p.display()
        ));
    }
    if !m.is_dir() {
        return Err(format!("{} is not a directory", p.display()));
    }
    if !trusted_owner(m.uid()) {
        return Err(format!(
            "{} is owned by uid {}, not by this user (uid {}) or root: whoever owns it can plant keys",
            p.display(),
            m.uid(),
            euid()
        ));
    }
    if m.mode() & 0o022 != 0 {
        return Err(format!(
            "{} is writable by group or others (mode {:o}): chmod 700 it",
            p.display(),
            m.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Why the directory holding the keyring at `p` cannot be trusted, if it cannot: one another user owns, or
/// may write without the sticky bit, could replace the keyring directory with its own.
pub(super) fn check_parent(p: &Path) -> std::result::Result<(), String> {
    let parent = match p.parent() {
        Some(q) if !q.as_os_str().is_empty() => q,
        _ => Path::new("."),
    };
    let m = fs::metadata(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    if !trusted_owner(m.uid()) {
        return Err(format!(
            "{} (which holds the keyring) is owned by uid {}, not by this user or root: its owner could \
             replace the keyring",
            parent.display(),
            m.uid()
        ));
    }
    if m.mode() & 0o022 != 0 && m.mode() & 0o1000 == 0 {
        return Err(format!(
            "{} (which holds the keyring) is writable by group or others without the sticky bit (mode {:o}): \
             anyone who can write it could replace the keyring",
            parent.display(),
            m.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Why a key file could not be read.
#[derive(Debug)]
pub(super) enum Unread {
    /// There is no file.
    Missing,
    /// There is something kvtier never reads as a key: a link, a FIFO or other non-file, another user's
    /// file, one group or others may access, or one too long to be a key.
    Untrusted(String),
    /// The file could not be read now (out of descriptors, an IO error).
    Io(io::Error),
}

/// The bytes of the key file at `p`, checked on the opened file (never following a link, never blocking
/// on a FIFO, never reading more than a key's length).
pub(super) fn read_secret(p: &Path) -> std::result::Result<Zeroizing<Vec<u8>>, Unread> {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(p);
    let f = match f {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Unread::Missing),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(Unread::Untrusted(format!(
                "{} is a symbolic link",
                p.display()
            )))
        }
        Err(e) => return Err(Unread::Io(e)),
    };
    let m = f.metadata().map_err(Unread::Io)?;
    let why = if !m.is_file() {
        Some("is not a regular file".to_owned())
    } else if !trusted_owner(m.uid()) {
        Some(format!("is owned by uid {}", m.uid()))
    } else if m.mode() & 0o077 != 0 {
        Some(format!(
            "is accessible by group or others (mode {:o}): chmod 600 it",
            m.mode() & 0o777
        ))
    } else if m.len() > MAX_SECRET {
        Some(format!("holds {} bytes, more than a key", m.len()))
    } else {
        None
    };
    if let Some(why) = why {
        return Err(Unread::Untrusted(format!("{} {why}", p.display())));
    }
    let mut buf = Zeroizing::new(Vec::with_capacity(MAX_SECRET as usize + 1));
    f.take(MAX_SECRET + 1)
        .read_to_end(&mut buf)
        .map_err(Unread::Io)?;
    if buf.len() as u64 > MAX_SECRET {
        return Err(Unread::Untrusted(format!(
            "{} grew past a key's length",
            p.display()
        )));
    }
    Ok(buf)
}

/// Creates `path` holding `bytes` (mode 0600) atomically: written and synced under a temporary name, then
/// linked into place, so no reader ever sees it partly written. Returns false (and changes nothing) if
/// anything (a file, a link) is at `path` already.
pub(super) fn create_secret(path: &Path, bytes: &[u8]) -> io::Result<bool> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut r = [0u8; 8];
    SystemRandom::new()
        .fill(&mut r)
        .map_err(|_| io::Error::other("the system random source failed"))?;
    let tmp = dir.join(format!(".tmp-{}-{}", std::process::id(), hex(&r)));
    let write = || -> io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    let linked = write().and_then(|()| match fs::hard_link(&tmp, path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    });
    let _ = fs::remove_file(&tmp);
    let linked = linked?;
    fs::File::open(dir)?.sync_all()?;
    Ok(linked)
}

/// Overwrites the regular file at `p` (never a link's target, never blocking on a FIFO) with zeros, syncs
/// it, and removes the name. A link or other non-file is only removed.
pub(super) fn wipe_and_remove(p: &Path) -> io::Result<()> {
    let wiped = fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(p)
        .and_then(|mut f| {
            let m = f.metadata()?;
            // a file of one link only: a hard link planted at the key's name would have the overwrite
            // land in the file it shares its bytes with (removing the name is all that is ours to do)
            if m.is_file() && std::os::unix::fs::MetadataExt::nlink(&m) == 1 {
                let zeros = vec![0u8; m.len().min(MAX_SECRET) as usize];
                f.write_all(&zeros)?;
                f.sync_all()?;
            }
            Ok(())
        });
    let wiped = match wiped {
        // a link, or a FIFO nobody reads: nothing of ours to wipe
        Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENXIO)) => Ok(()),
        w => w,
    };
    let removed = fs::remove_file(p);
    wiped.and(removed)
}
