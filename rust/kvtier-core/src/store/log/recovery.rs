//! Recovery at open: replaying the journal into an index (plausibility, slot conflicts resolved by
//! order) and trimming the data files to what the index holds (docs/STORE.md, "open").

use std::collections::BTreeSet;
use std::path::Path;

use super::replay_keys;
use crate::error::Result;
use crate::store::index::fasthash::FastMap;
use crate::store::index::{Entry, Index};
use crate::store::journal::{key_bytes_at, record_at, RecordRef as Record};
use crate::store::space::files::punch;
use crate::store::stats::OpenReport;
use crate::store::{io_err, ALIGN};

/// What replay keeps of a journal record (`journal::parse_resync_with(bytes, Rec::of)`): where it starts
/// in the journal, and a put's class, slot and length (a del's are 0: no put has class 0). 24 bytes where
/// a `RecordRef` takes 72; the rest is read at `off` where it is needed.
#[derive(Clone, Copy)]
pub(in crate::store) struct Rec {
    off: usize,
    class: u32,
    slot: u32,
    len: u64,
}

impl Rec {
    pub(in crate::store) fn of(r: Record<'_>, off: usize) -> Self {
        match r {
            Record::Put { at, .. } => {
                debug_assert!(at.class != 0, "the parser keeps no put of class 0");
                Rec {
                    off,
                    class: at.class,
                    slot: at.slot,
                    len: at.len,
                }
            }
            Record::Del { .. } => Rec {
                off,
                class: 0,
                slot: 0,
                len: 0,
            },
        }
    }

    fn is_put(&self) -> bool {
        self.class != 0
    }
}

/// The index rebuilt from the `records` of the journal's bytes `journal`, what replay found, and the
/// keys whose latest record was dropped. The index's map is sized for at least `presize` keys (a
/// writer's most objects, so that it does not rehash inside a batch).
pub(in crate::store) fn replay(
    dir: &Path,
    journal: &[u8],
    records: Vec<Rec>,
    report: &mut OpenReport,
    presize: usize,
) -> Result<(Index, Vec<String>)> {
    let key = |r: &Rec| record_at(journal, r.off).key();
    // Each key is named by the place of its first record (`first`, see `replay_keys`: no allocation
    // per record, and a key is copied only if it is live at the end); `live[id]` is where its live put
    // record is (`Live::NONE`: not live). Per size class, `owner[slot]` is `id + 1` of the live key
    // holding the slot (0: none); `class_ix` finds a class's state in `classes`, `last` remembers the
    // previous record's.
    let first = replay_keys::first_of_key(records.len(), |i| key_bytes_at(journal, records[i].off))
        .ok_or_else(|| {
            io_err(
                "replaying journal.log",
                std::io::Error::other(format!(
                    "{} records: replay takes fewer than 2^32",
                    records.len()
                )),
            )
        })?;
    let mut live: Vec<Live> = vec![Live::NONE; records.len()];
    let mut classes: Vec<ClassReplay> = Vec::new();
    let mut class_ix: FastMap<u32, u32> = FastMap::default();
    let mut last: Option<(u32, u32)> = None;
    let mut missing: BTreeSet<u32> = BTreeSet::new();
    // keys whose latest record was dropped (a later put or delete of the key takes it out again)
    let mut dropped: BTreeSet<&str> = BTreeSet::new();
    let remove = |live: &mut [Live], classes: &mut [ClassReplay], id: u32| {
        let l = std::mem::replace(&mut live[id as usize], Live::NONE);
        if l.rec != Live::NONE.rec {
            classes[l.class as usize].owner[l.slot as usize] = 0;
        }
    };
    for (rec, r) in records.iter().enumerate() {
        if !r.is_put() {
            if !dropped.is_empty() {
                dropped.remove(key(r));
            }
            remove(&mut live, &mut classes, first[rec]);
            continue;
        }
        let (class, slot, len) = (r.class, r.slot, r.len);
        let ci = match last {
            Some((c, i)) if c == class => i,
            _ => {
                let i = match class_ix.get(&class) {
                    Some(&i) => i,
                    None => {
                        let n = class_file_len(dir, class)?;
                        if n.is_none() {
                            missing.insert(class);
                        }
                        let i = u32::try_from(classes.len()).expect("fewer than 2^32 classes");
                        classes.push(ClassReplay {
                            file_len: n.unwrap_or(0),
                            owner: Vec::new(),
                        });
                        class_ix.insert(class, i);
                        i
                    }
                };
                last = Some((class, i));
                i
            }
        };
        // A record can only name bytes the store once wrote: an object inside its class file, a
        // length within its class. Anything else names no object and never sizes anything.
        let plausible = crate::store::journal::put_shape_ok(class, len)
            && u64::from(slot) * u64::from(class) + len <= classes[ci as usize].file_len;
        let id = first[rec];
        if !plausible {
            remove(&mut live, &mut classes, id);
            report.dropped_records += 1;
            dropped.insert(key(r));
            continue;
        }
        if !dropped.is_empty() {
            dropped.remove(key(r));
        }
        // R3: a later put naming a slot that another live key holds overwrote that key's bytes
        let o = &mut classes[ci as usize].owner;
        if o.len() <= slot as usize {
            o.resize(slot as usize + 1, 0);
        }
        let prev = o[slot as usize];
        if prev != 0 && prev - 1 != id {
            remove(&mut live, &mut classes, prev - 1);
            report.superseded_by_slot += 1;
        }
        remove(&mut live, &mut classes, id);
        classes[ci as usize].owner[slot as usize] = id + 1;
        live[id as usize] = Live {
            rec: rec as u32,
            class: ci,
            slot,
        };
    }
    report.missing_class_files = missing.into_iter().collect();
    let t = std::time::Instant::now();
    drop(first);
    drop(classes);
    // The live records, oldest first: a key's age is its put record's place in the journal, so marking
    // them and walking the records in order gives the LRU order without a sort.
    let mut is_live = vec![false; records.len()];
    let mut n = 0;
    for l in live.iter().filter(|l| l.rec != Live::NONE.rec) {
        is_live[l.rec as usize] = true;
        n += 1;
    }
    drop(live);
    let mut ix = Index::default();
    ix.map.reserve(n.max(presize));
    for r in records
        .iter()
        .zip(&is_live)
        .filter_map(|(r, &l)| l.then_some(r))
    {
        let next = ix.next.entry(r.class).or_insert(0);
        *next = (*next).max(r.slot + 1);
        ix.used += u64::from(r.class);
        ix.data_alloc += u64::from(r.class);
    }
    let by_age = records.iter().zip(is_live).filter_map(|(r, l)| {
        match l.then(|| record_at(journal, r.off)) {
            Some(Record::Put { key, at }) => Some((key, Entry::from(at))),
            _ => None,
        }
    });
    ix.load(n, by_age);
    report
        .open_phase_ns
        .push(("index_build", t.elapsed().as_nanos() as u64));
    Ok((ix, dropped.into_iter().map(str::to_owned).collect()))
}

/// Where replay found a key's live put record: its place in the journal's records, its class's place in
/// replay's classes and its slot.
#[derive(Clone, Copy)]
struct Live {
    rec: u32,
    class: u32,
    slot: u32,
}

impl Live {
    /// Not live.
    const NONE: Live = Live {
        rec: u32::MAX,
        class: 0,
        slot: 0,
    };
}

/// Replay's state of one size class: its data file's length and which live key holds each slot.
struct ClassReplay {
    file_len: u64,
    owner: Vec<u32>,
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
pub(in crate::store) fn trim_data_files(dir: &Path, ix: &mut Index, writable: bool) -> bool {
    let mut punch_ok = true;
    // per class, whether each slot below `next` is live
    let mut used: FastMap<u32, Vec<bool>> = FastMap::default();
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
