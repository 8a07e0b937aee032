//! Recovery at open: replaying the journal into an index (plausibility, slot conflicts resolved by
//! order) and trimming the data files to what the index holds (docs/STORE.md, "open").

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use super::files::punch;
use super::index::{Entry, Index};
use super::journal::RecordRef as Record;
use super::stats::OpenReport;
use super::{io_err, ALIGN};
use crate::error::Result;

/// The index rebuilt from `records`, what replay found, and the keys whose latest record was dropped.
/// The index's map is sized for at least `presize` keys (a writer's most objects, so that it does not
/// rehash inside a batch).
pub(super) fn replay(
    dir: &Path,
    records: Vec<Record<'_>>,
    report: &mut OpenReport,
    presize: usize,
) -> Result<(Index, Vec<String>)> {
    // Each key is interned once, borrowed from the journal's bytes (no allocation per record: a key is
    // copied only if it is live at the end): `ids` names it, `live[id]` is its entry and the order of its
    // put record, `owner[class][slot]` is `id + 1` of the live key holding the slot (0: none).
    let puts = records
        .iter()
        .filter(|r| matches!(r, Record::Put { .. }))
        .count();
    let mut ids: HashMap<&str, u32> = HashMap::with_capacity(puts);
    let mut live: Vec<Option<(Entry, u64)>> = Vec::with_capacity(puts);
    let mut owner: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut file_len: HashMap<u32, u64> = HashMap::new();
    let mut missing: BTreeSet<u32> = BTreeSet::new();
    // keys whose latest record was dropped (a later put or delete of the key takes it out again)
    let mut dropped: BTreeSet<&str> = BTreeSet::new();
    let mut order = 0u64;
    let remove =
        |live: &mut Vec<Option<(Entry, u64)>>, owner: &mut HashMap<u32, Vec<u32>>, id: u32| {
            if let Some((e, _)) = live[id as usize].take() {
                if let Some(o) = owner.get_mut(&e.class) {
                    o[e.slot as usize] = 0;
                }
            }
        };
    for r in records {
        match r {
            Record::Put { key, at } => {
                let (class, slot, len) = (at.class, at.slot, at.len);
                let flen = match file_len.get(&class) {
                    Some(&n) => n,
                    None => {
                        let n = class_file_len(dir, class)?;
                        if n.is_none() {
                            missing.insert(class);
                        }
                        let n = n.unwrap_or(0);
                        file_len.insert(class, n);
                        n
                    }
                };
                // A record can only name bytes the store once wrote: an object inside its class file, a
                // length within its class. Anything else names no object and never sizes anything.
                let plausible = super::index::put_shape_ok(class, len)
                    && u64::from(slot) * u64::from(class) + len <= flen;
                if !plausible {
                    if let Some(&id) = ids.get(key) {
                        remove(&mut live, &mut owner, id);
                    }
                    report.dropped_records += 1;
                    dropped.insert(key);
                    continue;
                }
                if !dropped.is_empty() {
                    dropped.remove(key);
                }
                let id = match ids.get(key) {
                    Some(&id) => id,
                    None => {
                        let id = u32::try_from(live.len()).expect("fewer than 2^32 keys");
                        ids.insert(key, id);
                        live.push(None);
                        id
                    }
                };
                // R3: a later put naming a slot that another live key holds overwrote that key's bytes
                let o = owner.entry(class).or_default();
                if o.len() <= slot as usize {
                    o.resize(slot as usize + 1, 0);
                }
                let prev = o[slot as usize];
                if prev != 0 && prev - 1 != id {
                    remove(&mut live, &mut owner, prev - 1);
                    report.superseded_by_slot += 1;
                }
                remove(&mut live, &mut owner, id);
                order += 1;
                owner.get_mut(&class).expect("created above")[slot as usize] = id + 1;
                live[id as usize] = Some((Entry::from(at), order));
            }
            Record::Del { key } => {
                if !dropped.is_empty() {
                    dropped.remove(key);
                }
                if let Some(&id) = ids.get(key) {
                    remove(&mut live, &mut owner, id);
                }
            }
        }
    }
    report.missing_class_files = missing.into_iter().collect();
    let t = std::time::Instant::now();
    let mut by_age: Vec<(String, Entry, u64)> = ids
        .into_iter()
        .filter_map(|(k, id)| live[id as usize].take().map(|(e, o)| (k.to_owned(), e, o)))
        .collect();
    drop(live);
    drop(owner);
    by_age.sort_unstable_by_key(|x| x.2);
    let mut ix = Index::default();
    ix.map.reserve(by_age.len().max(presize));
    for (_, e, _) in &by_age {
        let n = ix.next.entry(e.class).or_insert(0);
        *n = (*n).max(e.slot + 1);
        ix.used += u64::from(e.class);
        ix.data_alloc += u64::from(e.class);
    }
    ix.load(by_age.into_iter().map(|(k, e, _)| (k, e)));
    report
        .open_phase_ns
        .push(("index_build", t.elapsed().as_nanos() as u64));
    Ok((ix, dropped.into_iter().map(str::to_owned).collect()))
}

/// The length of `class`'s data file; `None` when it does not exist (or is not a file). Any other error
/// fails the open rather than dropping every record of the class.
fn class_file_len(dir: &Path, class: u32) -> Result<Option<u64>> {
    let p = dir.join(format!("class-{class}.dat"));
    match std::fs::symlink_metadata(&p) {
        Ok(m) if m.is_file() => Ok(Some(m.len())),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(format!("stat {}", p.display()), e)),
    }
}

/// Size classes of the data files in `dir`.
fn class_files(dir: &Path) -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let class: u32 = name
                .strip_prefix("class-")?
                .strip_suffix(".dat")?
                .parse()
                .ok()?;
            (class > 0 && u64::from(class) % ALIGN == 0).then_some(class)
        })
        .collect()
}

/// Writable open: each data file is cut to its highest live slot, and its free slots below that are
/// punched (holes) — or, where that is not possible, counted as free slots with blocks. Read-only open
/// only lists the free slots. Returns whether punching works here.
pub(super) fn trim_data_files(dir: &Path, ix: &mut Index, writable: bool) -> bool {
    let mut punch_ok = true;
    // per class, whether each slot below `next` is live
    let mut used: HashMap<u32, Vec<bool>> = HashMap::new();
    for e in ix.map.values() {
        let next = ix.next.get(&e.class).copied().unwrap_or(0) as usize;
        let u = used.entry(e.class).or_insert_with(|| vec![false; next]);
        u[e.slot as usize] = true;
    }
    let mut classes: BTreeSet<u32> = class_files(dir).into_iter().collect();
    classes.extend(ix.next.keys().copied());
    for class in classes {
        let next = ix.next.get(&class).copied().unwrap_or(0);
        let free: Vec<u32> = (0..next)
            .rev()
            .filter(|s| used.get(&class).is_none_or(|u| !u[*s as usize]))
            .collect();
        let c = u64::from(class);
        let path = dir.join(format!("class-{class}.dat"));
        let file = if writable {
            std::fs::OpenOptions::new().write(true).open(&path).ok()
        } else {
            None
        };
        let Some(f) = file else {
            // blocks unknown (read-only, or the file cannot be opened): free slots count as holding blocks
            ix.data_alloc += free.len() as u64 * c;
            ix.free.insert(class, free);
            continue;
        };
        if let Ok(m) = f.metadata() {
            let end = u64::from(next) * c;
            if m.len() > end && f.set_len(end).is_err() {
                ix.data_alloc += (m.len() - end).div_ceil(ALIGN) * ALIGN; // still on disk: counted
            }
        }
        // punch contiguous runs of free slots (ascending), one call each
        let mut holes = Vec::new();
        let mut kept = Vec::new();
        let mut asc = free.clone();
        asc.reverse();
        let mut k = 0;
        while k < asc.len() {
            let mut e = k + 1;
            while e < asc.len() && asc[e] == asc[e - 1] + 1 {
                e += 1;
            }
            let ok = punch_ok && punch(&f, u64::from(asc[k]) * c, (e - k) as u64 * c).is_ok();
            punch_ok &= ok;
            if ok { &mut holes } else { &mut kept }.extend_from_slice(&asc[k..e]);
            k = e;
        }
        ix.data_alloc += kept.len() as u64 * c;
        // hand out low slots first
        holes.reverse();
        kept.reverse();
        ix.holes.insert(class, holes);
        ix.free.insert(class, kept);
    }
    punch_ok
}
