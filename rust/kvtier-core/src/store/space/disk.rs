//! The file-system steps the store's files share: opening one read-write and owner-only, making a
//! directory's entries durable, and replacing a small file whole (a temporary file renamed over it).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens `p` read-write, creating it owner-only.
pub(in crate::store) fn open_rw(p: &Path, extra: i32) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(extra)
        .open(p)
}

/// Makes `dir`'s entries durable (a file just created in it must survive a crash with its data).
pub(in crate::store) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    crate::fault::check("dir_sync")?;
    File::open(dir)?.sync_all()
}

/// Writes `body` to the file `path`: a temporary file beside it (named by this process) renamed over it.
/// Not synced: for files that are advice (`STATS`).
pub(in crate::store) fn replace_unsynced(path: &Path, body: &str) -> std::io::Result<()> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp.{}", std::process::id()));
    let tmp = path.with_file_name(name);
    let _ = std::fs::remove_file(&tmp);
    let r = (|| {
        let f = open_rw(&tmp, libc::O_NOFOLLOW | libc::O_EXCL)?;
        std::os::unix::fs::FileExt::write_all_at(&f, body.as_bytes(), 0)?;
        std::fs::rename(&tmp, path)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}
