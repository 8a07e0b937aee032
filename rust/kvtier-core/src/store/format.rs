//! The on-disk format's version: a `FORMAT` file in the store root and in each namespace directory,
//! checked by every open (docs/STORE.md, "Format version").

use std::os::unix::fs::FileExt;
use std::path::Path;

use super::io_err;
use super::space::disk::{open_rw, sync_dir};
use crate::error::{Error, Result};

/// The format this kvtier writes and reads (defined beside the journal's records, which change most often).
pub use super::journal::{FORMATS_READ, FORMAT_VERSION};
/// The file's name, in the root and in each namespace directory.
pub const FORMAT_FILE: &str = "FORMAT";
const PREFIX: &str = "kvtier page store format ";

/// The text of a `FORMAT` file of `version`.
pub fn format_text(version: u32) -> String {
    format!("{PREFIX}{version}\n")
}

/// Checks `dir/FORMAT`; a missing one is this format (stores written before the file existed have it),
/// written when `writable`. A newer format, or a file that is not kvtier's, is an error that names the
/// versions and how to start over.
pub(super) fn check(dir: &Path, root: &Path, writable: bool) -> Result<()> {
    let p = dir.join(FORMAT_FILE);
    match std::fs::read(&p) {
        Ok(b) => match parse(&b) {
            Some(FORMAT_VERSION) => Ok(()),
            // an older format this kvtier reads: a writable open moves it to this one (atomically) before
            // it writes anything of the new format
            Some(v) if FORMATS_READ.contains(&v) => {
                if writable {
                    write(dir).map_err(|e| io_err(format!("writing {}", p.display()), e))?;
                }
                Ok(())
            }
            Some(v) => Err(Error::arg(
                "path",
                format!(
                    "{} holds a kvtier store of on-disk format {v}; this kvtier ({}) reads formats \
                     {FORMATS_READ:?} and {FORMAT_VERSION}{}: use a kvtier that reads format {v}, or delete the store (`rm -rf {}` \
                     with every process using it stopped) or point kvtier at another directory",
                    dir.display(),
                    env!("CARGO_PKG_VERSION"),
                    if v > FORMAT_VERSION {
                        " (the store was written by a newer kvtier)"
                    } else {
                        ""
                    },
                    root.display()
                ),
            )),
            None => Err(Error::arg(
                "path",
                format!(
                    "{} is not a kvtier format file (it starts {:?}): {} is damaged or not a kvtier \
                     store; this kvtier writes {:?}",
                    p.display(),
                    String::from_utf8_lossy(&b[..b.len().min(40)]),
                    dir.display(),
                    format_text(FORMAT_VERSION)
                ),
            )),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if writable {
                write(dir).map_err(|e| io_err(format!("writing {}", p.display()), e))?;
            }
            Ok(())
        }
        Err(e) => Err(io_err(format!("reading {}", p.display()), e)),
    }
}

fn parse(b: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(b).ok()?;
    let v = s.strip_prefix(PREFIX)?.strip_suffix('\n')?;
    if v.is_empty() || !v.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

/// Publishes `dir/FORMAT` atomically (a temporary file, synced, renamed; then the directory synced). Two
/// writers publishing at once write the same bytes.
fn write(dir: &Path) -> std::io::Result<()> {
    let tmp = dir.join(format!("{FORMAT_FILE}.tmp.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let f = open_rw(&tmp, libc::O_NOFOLLOW | libc::O_EXCL)?;
    let r = f
        .write_all_at(format_text(FORMAT_VERSION).as_bytes(), 0)
        .and_then(|()| f.sync_data())
        .and_then(|()| std::fs::rename(&tmp, dir.join(FORMAT_FILE)))
        .and_then(|()| sync_dir(dir));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_only_its_own_text() {
        assert_eq!(parse(format_text(1).as_bytes()), Some(1));
        assert_eq!(parse(b"kvtier page store format 7\n"), Some(7));
        for bad in [
            &b""[..],
            b"kvtier page store format \n",
            b"kvtier page store format 1",
            b"kvtier page store format -1\n",
            b"kvtier page store format 1 \n",
            b"kvtier page store format 99999999999\n",
            b"\xff\xfe",
            b"something else\n",
        ] {
            assert_eq!(parse(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
