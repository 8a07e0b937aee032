//! A store directory's namespaces as a whole: listing them, removing one safely, its budget
//! (docs/STORE.md, "Namespaces of a store directory").

use std::path::Path;
use std::time::UNIX_EPOCH;

use super::namespace::{check_owned_dir, held, try_lock};
use super::space::budget::{self, Table};
use super::space::disk::{open_rw, sync_dir};
use super::{format, io_err};
use crate::error::{Error, Result};

/// Prefix of a namespace directory being removed (renamed to it, then deleted).
pub const REMOVING: &str = ".removing-";

/// One namespace directory of a store root.
#[derive(Clone, Debug)]
pub struct NamespaceEntry {
    /// The directory's name (`ns-<16 hex>`, or `.removing-ns-…` for a removal that was interrupted).
    pub dir: String,
    /// Its `NAMESPACE` file, when it can be read.
    pub namespace: Option<String>,
    /// Bytes of disk blocks its files hold (`st_blocks`).
    pub disk_bytes: u64,
    /// When its journal last changed (a commit), Unix seconds.
    pub last_write_unix: Option<u64>,
    /// Whether a live process holds its `LOCK` now.
    pub live: bool,
    /// What it claims of the root's budget, and its writer's pid (0 once closed), from `BUDGET`.
    pub claim: Option<(u64, u32)>,
}

/// The root's budget (`None`: none) and its namespace directories, sorted by name. Reads only.
pub fn namespaces(root: &Path) -> Result<(Option<u64>, Vec<NamespaceEntry>)> {
    if !root.is_dir() {
        return Err(Error::arg(
            "path",
            format!("{}: no such store directory", root.display()),
        ));
    }
    format::check(root, root, false)?;
    let table = budget::read_table(root)?;
    let mut out = Vec::new();
    let rd =
        std::fs::read_dir(root).map_err(|e| io_err(format!("listing {}", root.display()), e))?;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !(valid_dir_name(&name) || name.strip_prefix(REMOVING).is_some_and(valid_dir_name)) {
            continue;
        }
        let dir = e.path();
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        let last_write_unix = std::fs::metadata(dir.join("journal.log"))
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_secs());
        let claim = table
            .as_ref()
            .and_then(|(_, slots)| slots.iter().find(|s| s.0 == name).map(|s| (s.1, s.2)));
        out.push(NamespaceEntry {
            namespace: std::fs::read_to_string(dir.join("NAMESPACE")).ok(),
            disk_bytes: budget::dir_blocks(&dir),
            last_write_unix,
            live: held(&dir),
            claim,
            dir: name,
        });
    }
    out.sort_by(|a, b| a.dir.cmp(&b.dir));
    Ok((table.map(|t| t.0).filter(|&b| b > 0), out))
}

/// Whether `name` is a namespace directory's name: `ns-` and 16 lowercase hex digits.
pub fn valid_dir_name(name: &str) -> bool {
    name.strip_prefix("ns-").is_some_and(|h| {
        h.len() == 16
            && h.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    })
}

/// Removes namespace directory `name` (`ns-<16 hex>`, or a `.removing-ns-…` left by an interrupted
/// removal) of the store at `root`; returns the bytes of disk blocks its files held. Refused while a
/// live process holds its `LOCK`, unless `force` (that process keeps its open files, and their space,
/// until it exits). The removal holds the `LOCK` and renames the directory away before deleting it, so a
/// writer opening the namespace at the same moment either is refused (`LOCK` held) or, once it gets the
/// lock, sees that its directory is gone and creates a new, empty one.
pub fn remove_namespace(root: &Path, name: &str, force: bool) -> Result<u64> {
    let base = name.strip_prefix(REMOVING).unwrap_or(name);
    if !valid_dir_name(base) {
        return Err(Error::arg(
            "namespace",
            format!("expected a namespace directory name (ns- and 16 hex digits), got {name:?}"),
        ));
    }
    let dir = root.join(name);
    if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir() || m.file_type().is_symlink()) {
        return Err(Error::arg(
            "namespace",
            format!("{}: no such namespace directory", dir.display()),
        ));
    }
    format::check(root, root, false)?;
    check_owned_dir(&dir)?;
    let lock = open_rw(&dir.join("LOCK"), libc::O_NOFOLLOW)
        .map_err(|e| io_err(format!("opening {}/LOCK", dir.display()), e))?;
    let locked = try_lock(&lock, libc::LOCK_EX);
    if !locked && !force {
        let pid = budget::read_table(root)
            .ok()
            .flatten()
            .and_then(|(_, slots)| slots.into_iter().find(|s| s.0 == base))
            .map_or(0, |s| s.2);
        return Err(Error::Os {
            what: format!(
                "{} is in use by a running process{} (its LOCK is held); stop it first, or force the removal",
                dir.display(),
                if pid > 0 { format!(" (pid {pid})") } else { String::new() }
            ),
            source: std::io::Error::from_raw_os_error(libc::EBUSY),
        });
    }
    let bytes = budget::dir_blocks(&dir);
    // the slot keeps counting the blocks under a name of its own until they are gone; a writer opening
    // the namespace again meanwhile takes a new one (a leftover of an interrupted removal was retired then)
    let table = Table::open(root, false)?;
    let retired = match (&table, name.starts_with(REMOVING)) {
        (Some(t), false) => t.retire(base)?,
        _ => None,
    };
    let gone = if name.starts_with(REMOVING) {
        dir.clone()
    } else {
        let gone = root.join(format!("{REMOVING}{name}"));
        if gone.exists() {
            std::fs::remove_dir_all(&gone)
                .map_err(|e| io_err(format!("removing {}", gone.display()), e))?;
        }
        std::fs::rename(&dir, &gone)
            .map_err(|e| io_err(format!("renaming {}", dir.display()), e))?;
        gone
    };
    let _ = sync_dir(root);
    std::fs::remove_dir_all(&gone)
        .map_err(|e| io_err(format!("removing {}", gone.display()), e))?;
    let _ = sync_dir(root);
    drop(lock);
    // a forced removal of a live namespace leaves its retired slot: that writer still holds the space and
    // publishes into it; the slot is freed once it is gone (`Table::reconcile`)
    if let (true, Some(t), Some(r)) = (locked, &table, &retired) {
        t.release(r)?;
    }
    Ok(bytes)
}

/// The store's budget (`None`: none).
pub fn budget(root: &Path) -> Result<Option<u64>> {
    Ok(budget::read_table(root)?.map(|t| t.0).filter(|&b| b > 0))
}

/// Sets the budget of the existing store at `root` (`None` removes it). Writers of the store honour it from
/// their next growth on, and evict down to it then.
pub fn set_budget(root: &Path, bytes: Option<u64>) -> Result<()> {
    if let Some(b @ 0..4096) = bytes {
        return Err(Error::arg(
            "budget_bytes",
            format!("must be >= 4096, got {b}"),
        ));
    }
    if !root.is_dir() {
        return Err(Error::arg(
            "path",
            format!("{}: no such store directory", root.display()),
        ));
    }
    format::check(root, root, true)?;
    let t = Table::open(root, true)?.expect("created");
    t.set_budget(bytes.map_or(0, |b| b / 4096 * 4096));
    Ok(())
}
