//! Followers that look at the journal only on a miss or every `log::follow::RECHECK`, reviewed adversarially:
//! a follower that misses two journal swaps, one that read a record that was cut back, one whose deleted
//! key's slot another key took. Compaction racing every change: `tests::compaction_races`.

use super::{bytes_at, get1, opts, payload, put1, tmp, SERIAL};
use crate::store::log::follow;
use crate::store::*;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;

fn ino(s: &PageStore) -> u64 {
    std::fs::metadata(s.dir().join("journal.log"))
        .unwrap()
        .ino()
}

fn journal_len(s: &PageStore) -> u64 {
    std::fs::metadata(s.dir().join("journal.log"))
        .unwrap()
        .len()
}

/// Puts `n` keys named `<prefix>-<i>` and deletes them again: the journal grows by 2n records, nothing
/// stays.
fn churn(w: &PageStore, prefix: &str, n: usize, p: usize) {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-{i:060}")).collect();
    let objs: Vec<(&str, usize, u64)> = keys.iter().map(|k| (k.as_str(), p, 4096)).collect();
    // SAFETY: every object is the first 4096 bytes of a live payload.
    assert!(unsafe { w.put(&objs) }.unwrap().iter().all(|&b| b));
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert_eq!(w.delete(&refs).unwrap(), n);
}

/// A follower tells a compacted journal from the one it read by the inode number. Once it has rebuilt
/// from a compacted journal it does not hold that file open, so after two more compactions between its
/// looks the writer's journal can have the same number (ext4 hands a freed inode out again at once):
/// the follower then took the new journal for the old one grown, read it from its old offset, and never
/// saw the records before it — an object the writer acknowledged before the lookup was a miss for good,
/// and a deleted one was served for good.
#[test]
fn a_follower_that_misses_two_journal_swaps_is_not_fooled_by_a_reused_inode() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 4096, 41);
    let p = src.as_ptr() as usize;
    let w = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    for i in 0..10 {
        assert!(put1(&w, &format!("old-{i}"), p, 4096));
    }
    let r = PageStore::open_read_only(&root, "ns").unwrap();
    w.compact().unwrap();
    // a long journal, which the follower reads to its end (its offset)
    churn(&w, "f", 300, p);
    assert_eq!(r.exists(&["nothing"]), vec![false]);
    let followed = ino(&w);
    let offset = journal_len(&w);
    assert!(offset > 50_000);
    // swaps the follower misses, until the journal has the number of the one it read (or tries run out:
    // the file system does not hand it out again)
    let mut reused = false;
    for round in 0..8 {
        assert!(put1(&w, &format!("new-{round}"), p + 4096, 4096));
        assert_eq!(w.delete(&[format!("old-{round}").as_str()]).unwrap(), 1);
        w.compact().unwrap();
        if ino(&w) == followed {
            reused = true;
            break;
        }
    }
    eprintln!("journal inode reused after compactions: {reused}");
    // the journal grows past the follower's offset again (without a compaction: the floor is 1 MiB)
    churn(&w, "g", 400, p);
    assert!(journal_len(&w) > offset);
    let dst = payload(1, 4096, 0);
    assert!(
        get1(&r, "new-0", dst.as_ptr() as usize, 4096),
        "an acknowledged object is a miss for the follower"
    );
    assert_eq!(bytes_at(&dst, 0, 4096), bytes_at(&src, 4096, 4096));
    std::thread::sleep(follow::RECHECK + std::time::Duration::from_millis(20));
    assert_eq!(
        r.exists(&["old-0"]),
        vec![false],
        "a deleted object is served past the recheck interval"
    );
    let (mut a, mut b) = (w.keys(), r.keys());
    a.sort();
    b.sort();
    assert_eq!(a, b);
    std::fs::remove_dir_all(root).unwrap();
}

/// A follower reads the writer's journal while an append is in flight. When the append's sync fails the
/// writer cuts the journal back; if the follower looked between the write and the cut, and the writer's
/// next appends grow the journal past where the follower stopped before it looks again, the follower took
/// the journal for the one it read, grown: it read on from its offset and never saw the records that
/// replaced the cut ones (same length, same inode) — an acknowledged object was a miss for it until the
/// journal reached its next compaction. Now a cut-back makes the next compaction step rewrite the journal
/// into a new file (here, a small journal, in the step the failed put hands over), and the follower rebuilds.
#[test]
fn a_follower_that_read_a_record_that_was_cut_back_finds_what_replaced_it() {
    use crate::fault::{self, Fault};
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 4096, 43);
    let p = src.as_ptr() as usize;
    let w = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert!(put1(&w, "a", p, 4096));
    let r = PageStore::open_read_only(&root, "ns").unwrap();
    assert_eq!(r.exists(&["a"]), vec![true]);
    fault::set("journal_sync", 0, 1, Fault::Error(libc::EIO));
    fault::set(
        "journal_cut",
        0,
        1,
        Fault::Delay(std::time::Duration::from_millis(300)),
    );
    std::thread::scope(|sc| {
        let t = sc.spawn(|| put1(&w, "x", p, 4096));
        std::thread::sleep(std::time::Duration::from_millis(150));
        // between the write and the cut: the follower sees x's record
        assert_eq!(r.exists(&["x"]), vec![true]);
        assert!(
            !t.join().unwrap(),
            "the put whose sync failed is not acknowledged"
        );
    });
    fault::clear();
    w.flush_background(); // the step the failed put handed to the background thread
    assert!(
        !w.log.journal().rewrite_due,
        "the failed put's step rewrote the journal"
    );
    // acknowledged now, its record where x's was
    assert!(put1(&w, "y", p + 4096, 4096));
    assert_eq!(
        r.exists(&["y"]),
        vec![true],
        "an acknowledged object is a miss for the follower"
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// Within `log::follow::RECHECK` a follower does not look at the journal while its lookups hit. A key the
/// writer deleted whose slot another key took meanwhile is then still in its index, naming that slot: the
/// bytes there are the other key's, and the checksum binds bytes to their key, so the read is a miss (a
/// counted corrupt read), never the other key's bytes. Where the other key has the very same bytes, they
/// are the deleted key's own bytes. The miss makes the follower look: the delete and the new key arrive.
#[test]
fn a_follower_never_serves_the_bytes_of_the_key_that_took_a_deleted_keys_slot() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let root = tmp();
    let src = payload(2, 4096, 47);
    let p = src.as_ptr() as usize;
    let w = PageStore::open(&root, "ns", opts(1 << 30)).unwrap();
    assert!(put1(&w, "a", p, 4096));
    assert!(put1(&w, "c", p, 4096));
    let r = PageStore::open_read_only(&root, "ns").unwrap();
    assert_eq!(r.exists(&["a", "c"]), vec![true, true]);
    let dst = payload(1, 4096, 0);
    for (other, bytes) in [("b", p + 4096), ("d", p)] {
        let gone = if other == "b" { "a" } else { "c" };
        let slot = w.log.index().map[gone].slot;
        w.delete(&[gone]).unwrap();
        assert!(put1(&w, other, bytes, 4096));
        assert_eq!(
            w.log.index().map[other].slot,
            slot,
            "{other} took {gone}'s slot"
        );
        let t = std::time::Instant::now();
        let looks = r.log.follow().unwrap().looks;
        let served = get1(&r, gone, dst.as_ptr() as usize, 4096);
        assert!(
            t.elapsed() < follow::RECHECK,
            "too slow to test within the interval"
        );
        assert_eq!(
            r.log.follow().unwrap().looks,
            looks,
            "the lookup looked at the journal"
        );
        if other == "b" {
            assert!(!served, "{gone} served with {other}'s bytes");
            assert_eq!(r.stats.corrupt_reads.load(Ordering::Relaxed), 1);
        } else {
            // the same bytes: the deleted key's own, within the interval
            assert!(served);
            assert_eq!(bytes_at(&dst, 0, 4096), bytes_at(&src, 0, 4096));
        }
        assert_eq!(r.exists(&[gone, other]), vec![false, true]);
    }
    std::fs::remove_dir_all(root).unwrap();
}
