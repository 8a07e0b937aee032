//! A namespace's directory: its name, owner-only creation and checks, the writer's `LOCK`, and the
//! `NAMESPACE` file that guards against hash collisions.

use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, FileExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::io_err;
use super::space::disk::open_rw;
use crate::error::{Error, Result};

/// The directory name of `namespace` under the store root.
pub fn namespace_dir(namespace: &str) -> String {
    let h = crate::hash::sha256_hex(namespace.as_bytes());
    format!("ns-{}", &h[..16])
}

/// Creates `p` (mode 0700) or checks that the existing one is a real directory — not a symlink someone
/// planted to redirect the store — owned by this process's user; then makes it owner-only.
fn owner_only_dir(p: &Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io_err(format!("creating {}", p.display()), e)),
    }
    check_owned_dir(p)?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| io_err(format!("chmod {}", p.display()), e))
}

/// Checks that `p` is a real directory (not a symlink) owned by this process's user.
pub(super) fn check_owned_dir(p: &Path) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let md =
        std::fs::symlink_metadata(p).map_err(|e| io_err(format!("stat {}", p.display()), e))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if !md.file_type().is_dir() || md.uid() != euid {
        return Err(Error::arg(
            "path",
            format!(
                "{} must be a directory (not a symlink) owned by this user (uid {euid}); found {} owned by uid {}",
                p.display(),
                if md.file_type().is_symlink() { "a symlink" } else if md.is_dir() { "a directory" } else { "a file" },
                md.uid()
            ),
        ));
    }
    Ok(())
}

/// The namespace directory, opened for writing: created if needed, locked, its `NAMESPACE` checked or
/// published. The returned `File` holds the lock for as long as it lives.
pub(super) fn open_writable(root: &Path, namespace: &str) -> Result<(PathBuf, File)> {
    // directories this creates are owner-only; existing parents are left as they are
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
        .map_err(|e| io_err(format!("creating {}", root.display()), e))?;
    super::format::check(root, root, true)?;
    let dir = root.join(namespace_dir(namespace));
    let lock = lock_dir(&dir, namespace)?;
    let ns_file = dir.join("NAMESPACE");
    match check_namespace_file(&dir, namespace)? {
        true => {}
        false => {
            let tmp = dir.join("NAMESPACE.tmp");
            (|| -> std::io::Result<()> {
                // a leftover (or planted) NAMESPACE.tmp is replaced, never followed: a symlink there
                // would otherwise let the truncation below hit the file it points to
                match std::fs::remove_file(&tmp) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
                let f = open_rw(&tmp, libc::O_NOFOLLOW | libc::O_EXCL)?; // new, 0600 whatever the umask
                f.write_all_at(namespace.as_bytes(), 0)?;
                f.sync_data()
            })()
            .map_err(|e| io_err("writing NAMESPACE", e))?;
            std::fs::rename(&tmp, &ns_file).map_err(|e| io_err("publishing NAMESPACE", e))?;
        }
    }
    Ok((dir, lock))
}

/// Creates (or checks) the namespace directory `dir` and takes its `LOCK`. The lock is taken on the file
/// the directory holds when it is had: a `kvtier remove` that held it meanwhile renamed the directory
/// away, and the lock of a removed directory guards nothing, so the open starts again.
fn lock_dir(dir: &Path, namespace: &str) -> Result<File> {
    for _ in 0..8 {
        owner_only_dir(dir)?;
        // the lock first: two processes creating one namespace must not race on NAMESPACE.tmp
        let lock = open_rw(&dir.join("LOCK"), 0).map_err(|e| io_err("opening LOCK", e))?;
        // a read-only inspector takes a shared lock for an instant to see whether a writer is there: retry
        // for up to 200 ms before calling the namespace taken
        let mut locked = try_lock(&lock, libc::LOCK_EX);
        for _ in 0..20 {
            if locked {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            locked = try_lock(&lock, libc::LOCK_EX);
        }
        if !locked {
            return Err(Error::Os {
                what: format!(
                    "namespace {namespace:?} at {} is already open for writing (LOCK held)",
                    dir.display()
                ),
                source: std::io::Error::last_os_error(),
            });
        }
        if same_file(&lock, &dir.join("LOCK")) {
            return Ok(lock);
        }
    }
    Err(io_err(
        format!("{}: removed again and again while opening", dir.display()),
        std::io::Error::from_raw_os_error(libc::EAGAIN),
    ))
}

/// Whether the open file `f` is the file at `p` now (not one unlinked or renamed away since).
pub(super) fn same_file(f: &File, p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (f.metadata(), std::fs::symlink_metadata(p)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino() && a.nlink() > 0,
        _ => false,
    }
}

/// The existing namespace directory, for reading only: nothing is created or written. Returns the
/// directory and whether a writer holds its `LOCK` now.
pub(super) fn open_read_only(root: &Path, namespace: &str) -> Result<(PathBuf, bool)> {
    super::format::check(root, root, false)?;
    let dir = root.join(namespace_dir(namespace));
    let md = std::fs::symlink_metadata(&dir)
        .map_err(|e| io_err(format!("no namespace directory {}", dir.display()), e))?;
    if !md.file_type().is_dir() {
        return Err(Error::arg(
            "path",
            format!("{} is not a directory", dir.display()),
        ));
    }
    if !check_namespace_file(&dir, namespace)? {
        // a writer creating the namespace right now publishes NAMESPACE a moment after the directory
        return Err(io_err(
            format!("{} has no NAMESPACE file (yet)", dir.display()),
            std::io::Error::from_raw_os_error(libc::ENOENT),
        ));
    }
    Ok((dir.clone(), held(&dir)))
}

/// Whether a writer holds the `LOCK` of namespace directory `dir` now. A shared lock that cannot be had
/// means a writer holds it; the probe takes it only for an instant and writes nothing. A `LOCK` that
/// cannot even be opened read-only counts as held.
pub fn held(dir: &Path) -> bool {
    match File::open(dir.join("LOCK")) {
        Ok(f) => {
            let free = try_lock(&f, libc::LOCK_SH);
            drop(f); // closing releases a lock it took
            !free
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(_) => true,
    }
}

/// True when `dir/NAMESPACE` holds `namespace`, false when it does not exist; an error when it names
/// another namespace (or is not even UTF-8): not ours to reuse.
fn check_namespace_file(dir: &Path, namespace: &str) -> Result<bool> {
    let ns_file = dir.join("NAMESPACE");
    match std::fs::read(&ns_file) {
        Ok(s) if s == namespace.as_bytes() => Ok(true),
        Ok(s) => Err(Error::arg(
            "namespace",
            format!(
                "directory {} belongs to namespace {:?}, not {namespace:?}",
                dir.display(),
                String::from_utf8_lossy(&s)
            ),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(format!("reading {}", ns_file.display()), e)),
    }
}

pub(super) fn try_lock(f: &File, how: i32) -> bool {
    // SAFETY: flock on a file descriptor we own.
    unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(f), how | libc::LOCK_NB) == 0 }
}
