//! The format version, the budget table's damage, namespace removal (against live and racing writers) and
//! the counters the writer leaves on disk.

use super::budget::{claims, held, with_budget, OBJ};
use super::{get1, opts, payload, put1, tmp, SERIAL};
use crate::store::format::{format_text, FORMATS_READ, FORMAT_FILE, FORMAT_VERSION};
use crate::store::lifecycle::{namespaces, remove_namespace};
use crate::store::space::budget;
use crate::store::*;

#[test]
fn format_files_are_written_checked_and_a_future_or_foreign_one_is_refused() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    // a root without FORMAT (a store of the current format written before the file existed): opens
    assert!(
        PageStore::open_read_only(&root, "m").is_err(),
        "nothing there yet"
    );
    {
        let s = PageStore::open(&root, "m", opts(1 << 30)).unwrap();
        let text = format_text(FORMAT_VERSION);
        assert_eq!(
            std::fs::read_to_string(root.join(FORMAT_FILE)).unwrap(),
            text
        );
        assert_eq!(
            std::fs::read_to_string(s.dir().join(FORMAT_FILE)).unwrap(),
            text
        );
    }
    std::fs::remove_file(root.join(FORMAT_FILE)).unwrap();
    let ns_dir = root.join(namespace_dir("m"));
    std::fs::remove_file(ns_dir.join(FORMAT_FILE)).unwrap();
    drop(PageStore::open_read_only(&root, "m").unwrap());
    assert!(
        !root.join(FORMAT_FILE).exists(),
        "a read-only open writes nothing"
    );
    drop(PageStore::open(&root, "m", opts(1 << 30)).unwrap());
    assert!(root.join(FORMAT_FILE).exists() && ns_dir.join(FORMAT_FILE).exists());
    // an older format this kvtier reads (format 1: before coded records): a read-only open reads it as it
    // is, a writable open moves both files to this format
    for at in [root.clone(), ns_dir.clone()] {
        std::fs::write(at.join(FORMAT_FILE), format_text(1)).unwrap();
    }
    drop(PageStore::open_read_only(&root, "m").unwrap());
    assert_eq!(
        std::fs::read_to_string(root.join(FORMAT_FILE)).unwrap(),
        format_text(1)
    );
    drop(PageStore::open(&root, "m", opts(1 << 30)).unwrap());
    for at in [root.clone(), ns_dir.clone()] {
        assert_eq!(
            std::fs::read_to_string(at.join(FORMAT_FILE)).unwrap(),
            format_text(FORMAT_VERSION)
        );
    }
    // a future format, at the root or in one namespace: refused, naming both versions and what to do
    let future = FORMAT_VERSION + 5;
    for at in [root.clone(), ns_dir.clone()] {
        std::fs::write(at.join(FORMAT_FILE), format_text(future)).unwrap();
        for e in [
            PageStore::open(&root, "m", opts(1 << 30)).err().unwrap(),
            PageStore::open_read_only(&root, "m").err().unwrap(),
        ] {
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("format {future}"))
                    && msg.contains(&format!(
                        "reads formats {FORMATS_READ:?} and {FORMAT_VERSION}"
                    ))
                    && msg.contains("rm -rf"),
                "{msg}"
            );
        }
        std::fs::write(at.join(FORMAT_FILE), format_text(FORMAT_VERSION)).unwrap();
    }
    // a new namespace is not created in a root of a future format
    std::fs::write(root.join(FORMAT_FILE), format_text(FORMAT_VERSION + 1)).unwrap();
    assert!(PageStore::open(&root, "other", opts(1 << 30)).is_err());
    assert!(!root.join(namespace_dir("other")).exists());
    // a damaged or foreign file
    for junk in [
        &b"kvtier page store format x\n"[..],
        b"",
        b"\x00\x01garbage",
    ] {
        std::fs::write(root.join(FORMAT_FILE), junk).unwrap();
        let msg = PageStore::open(&root, "m", opts(1 << 30))
            .err()
            .unwrap()
            .to_string();
        assert!(msg.contains("not a kvtier format file"), "{msg}");
    }
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_damaged_budget_table_is_refused_with_what_to_do() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    drop(PageStore::open(&root, "m", opts(1 << 30)).unwrap());
    std::fs::write(root.join(budget::BUDGET_FILE), b"not a table").unwrap();
    let msg = PageStore::open(&root, "m", opts(1 << 30))
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("not a kvtier budget table") && msg.contains("remove it"),
        "{msg}"
    );
    std::fs::remove_file(root.join(budget::BUDGET_FILE)).unwrap();
    let s = PageStore::open(&root, "m", opts(1 << 30)).unwrap();
    assert!(
        claims(&root) >= held(&s),
        "rebuilt from the namespaces on disk"
    );
    drop(s);
    // a table whose creator stopped before writing its header (empty, or sized with a zero header) is
    // nothing yet: readers see none, the next writer initializes it
    for len in [0u64, 69632] {
        let f = std::fs::File::create(root.join(budget::BUDGET_FILE)).unwrap();
        f.set_len(len).unwrap();
        assert!(budget::read_table(&root).unwrap().is_none());
        assert!(namespaces(&root).unwrap().0.is_none());
        drop(PageStore::open(&root, "m", with_budget(1 << 30)).unwrap());
        assert_eq!(namespaces(&root).unwrap().0, Some(1 << 30));
    }
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn removal_is_refused_while_a_writer_holds_the_lock_unless_forced() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(1, OBJ as usize, 2);
    let p = src.as_ptr() as usize;
    let s = PageStore::open(&root, "live", with_budget(8 << 20)).unwrap();
    assert!(put1(&s, "k", p, OBJ));
    let name = namespace_dir("live");
    let e = remove_namespace(&root, &name, false).err().unwrap();
    assert!(e.to_string().contains("in use by a running process"), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("pid {}", std::process::id())),
        "{e}"
    );
    assert!(
        put1(&s, "k2", p, OBJ),
        "the refused removal changed nothing"
    );
    for bad in ["../x", "ns-123", "ns-0123456789abcdeg", "NAMESPACE", ""] {
        let e = remove_namespace(&root, bad, false).err().unwrap();
        assert!(
            e.to_string().contains("invalid argument `namespace`"),
            "{e}"
        );
    }
    // forced: the directory goes; the live writer keeps its claim (its files stay open) until it ends
    // under a retired name: a writer opening the namespace again takes a new slot, the old one still counts
    remove_namespace(&root, &name, true).unwrap();
    assert!(!root.join(&name).exists());
    let retired = |root: &Path| {
        let slots = budget::read_table(root).unwrap().unwrap().1;
        slots
            .into_iter()
            .find(|s| s.0.starts_with('~') && budget::retired_base(&s.0) == name)
    };
    assert!(retired(&root).is_some_and(|r| r.1 >= held(&s) && r.2 == std::process::id()));
    let again = PageStore::open(&root, "live", opts(1 << 30)).unwrap();
    assert!(put1(&again, "k", p, OBJ), "a new, empty namespace");
    assert!(
        put1(&s, "k3", p, OBJ),
        "the old writer goes on, into its removed files"
    );
    assert!(retired(&root).is_some_and(|r| r.1 >= held(&s)));
    drop(s);
    drop(PageStore::open(&root, "next", opts(1 << 30)).unwrap()); // reconciles: the retired slot is freed
    assert!(retired(&root).is_none());
    let (_, list) = namespaces(&root).unwrap();
    assert_eq!(list.len(), 2);
    assert!(list.iter().any(|e| e.dir == name && e.live));
    drop(again);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn a_writer_opening_while_its_namespace_is_removed_gets_a_whole_store() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(1, 8192, 4);
    let dst = payload(1, 8192, 5);
    let (p, d) = (src.as_ptr() as usize, dst.as_ptr() as usize);
    let name = namespace_dir("raced");
    let stop = AtomicBool::new(false);
    let (mut opened, mut removed) = (0, 0);
    std::thread::scope(|sc| {
        let remover = sc.spawn(|| {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += usize::from(remove_namespace(&root, &name, false).is_ok());
            }
            n
        });
        for i in 0..200 {
            let Ok(s) = PageStore::open(&root, "raced", opts(1 << 30)) else {
                continue; // refused: the removal held the LOCK
            };
            opened += 1;
            let key = format!("k{i}");
            // an acknowledged page of an open store reads back while it is open (removal waits for it)
            if put1(&s, &key, p, 8192) {
                assert!(get1(&s, &key, d, 8192));
                assert!(
                    s.dir().join("journal.log").exists(),
                    "the store's directory is its own"
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
        removed = remover.join().unwrap();
    });
    eprintln!("opened {opened}, removed {removed}");
    assert!(opened > 0 && removed > 0);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn the_writer_leaves_its_counters_on_disk() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(1, 8192, 6);
    let p = src.as_ptr() as usize;
    let dir = {
        let s = PageStore::open(&root, "m", with_budget(1 << 30)).unwrap();
        assert!(put1(&s, "a", p, 8192));
        assert!(get1(&s, "a", p, 8192));
        assert!(!get1(&s, "nope", p, 8192));
        s.dir().to_owned()
    };
    let text = std::fs::read_to_string(dir.join(stats::file::STATS_FILE)).unwrap();
    for want in [
        "\"hits\": 1,",
        "\"misses\": 1,",
        "\"puts\": 1,",
        "\"bytes_written\": 8192,",
        "\"capacity_bytes\": 1073741824,",
        "\"budget_bytes\": 1073741824,",
        "\"objects\": 1,",
    ] {
        assert!(text.contains(want), "{want} not in {text}");
    }
    assert!(text.contains(&format!("\"pid\": {},", std::process::id())));
    std::fs::remove_dir_all(root).unwrap();
}
