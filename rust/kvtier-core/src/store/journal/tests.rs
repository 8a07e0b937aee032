//! The journal's records: round trips of every kind, torn tails, resynchronisation.

use super::*;
use proptest::prelude::*;

#[test]
fn round_trip_and_torn_tail() {
    let recs = vec![
        Record::Put {
            key: "a".repeat(64),
            at: Placement::new(8192, 3, 5000, 77),
        },
        Record::Del { key: "b".into() },
        Record::Put {
            key: "t0123456789abcdef.x.k".into(),
            at: Placement::new(8192, 4, 8192, 78)
                .with_seal(Some(std::array::from_fn(|i| i as u8 + 1))),
        },
        Record::Put {
            key: "coded.k".into(),
            at: Placement::new(4096, 5, 3000, 79).with_coded(Some(4 << 20)),
        },
        Record::Put {
            key: "coded sealed.v".into(),
            at: Placement::new(8192, 6, 5000, 80)
                .with_seal(Some(std::array::from_fn(|i| i as u8 + 7)))
                .with_coded(Some(9000)),
        },
        Record::Put {
            key: "../../etc/x".into(),
            at: Placement::new(4096, 0, 1, 1),
        },
    ];
    let mut buf = Vec::new();
    for r in &recs {
        r.encode(&mut buf);
    }
    let (got, n) = parse(&buf);
    assert_eq!(got, recs);
    assert_eq!(n, buf.len());
    for cut in 0..buf.len() {
        let (got, n) = parse(&buf[..cut]);
        assert!(n <= cut);
        assert_eq!(got[..], recs[..got.len()]);
    }
    let mut bad = buf.clone();
    let last = bad.len() - 6;
    bad[last] ^= 0xff;
    assert_eq!(parse(&bad).0.len(), recs.len() - 1);
}

/// Whether `got` is `all` with some records left out (none added, none changed, order kept).
fn subsequence(got: &[Record], all: &[Record]) -> bool {
    let mut it = all.iter();
    got.iter().all(|g| it.any(|a| a == g))
}

#[test]
fn a_del_with_nonzero_unused_fields_is_not_a_record() {
    let mut buf = Vec::new();
    Record::Del { key: "k".into() }.encode(&mut buf);
    assert_eq!(parse(&buf).0.len(), 1);
    buf[layout::CLASS.at] = 1; // a class byte
    let n = buf.len() - layout::RECORD_CRC_LEN;
    let rc = crc32c::crc32c(&buf[..n]);
    buf[n..].copy_from_slice(&rc.to_le_bytes());
    assert!(parse(&buf).0.is_empty());
}

proptest! {
    /// Keys the store accepts (no control characters) may hold the magic, any printable text and any
    /// other UTF-8, and objects' checksums are arbitrary: whatever a crash or damage leaves of such a
    /// journal — cut at any byte, a run of bytes zeroed (a lost sector) or flipped — the parser finds
    /// only records that were written, never one made of the bytes inside another (a record's kind
    /// byte is 1 or 2, a control character).
    #[test]
    fn no_record_is_found_inside_an_accepted_key(
        keys in proptest::collection::vec(proptest::collection::vec(prop_oneof![
            Just("JTVK".to_string()), Just("KVTJ".to_string()), "[ -~]{1,12}", Just("\u{e9}".to_string()),
            Just("\u{4e2d}".to_string()), Just("\u{7ff}".to_string())], 1..24), 1..7),
        puts in proptest::collection::vec(any::<bool>(), 7),
        crcs in proptest::collection::vec(any::<u32>(), 7),
        cut in any::<usize>(), at in any::<usize>(), width in 1usize..700, zero in any::<bool>()) {
        let recs: Vec<Record> = keys.iter().enumerate().map(|(i, parts)| {
            let key: String = parts.concat();
            if puts[i] {
                Record::Put { key, at: Placement::new(4096 * (i as u32 + 1), i as u32, 4096, crcs[i]), }
            } else {
                Record::Del { key }
            }
        }).collect();
        let mut buf = Vec::new();
        for r in &recs { r.encode(&mut buf); }
        let (i, n) = (at % buf.len(), buf.len());
        for b in &mut buf[i..(i + width).min(n)] { *b = if zero { 0 } else { *b ^ 0x5a }; }
        let p = parse_resync(&buf);
        prop_assert!(subsequence(&p.records, &recs), "{:?} from {:?}", p.records, recs);
        let torn = &buf[..cut % (buf.len() + 1)];
        let p = parse_resync(torn);
        prop_assert!(subsequence(&p.records, &recs), "{:?} from {:?}", p.records, recs);
    }

    #[test]
    fn parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let (recs, n) = parse(&bytes);
        prop_assert!(n <= bytes.len());
        prop_assert!(recs.len() <= bytes.len() / (FIXED + layout::RECORD_CRC_LEN) + 1);
    }

    #[test]
    fn mutated_journal_yields_a_prefix(seed_keys in proptest::collection::vec("[a-f0-9]{1,70}", 1..6),
                                       flip in any::<usize>()) {
        let recs: Vec<Record> = seed_keys.iter().enumerate().map(|(i, k)| Record::Put {
            key: k.clone(), at: Placement::new(4096, i as u32, 10, i as u32), }).collect();
        let mut buf = Vec::new();
        for r in &recs { r.encode(&mut buf); }
        let i = flip % buf.len();
        buf[i] ^= 0x5a;
        let (got, _) = parse(&buf);
        // a flipped byte can only shorten the valid prefix, never change a record
        prop_assert!(got.len() < recs.len());
        prop_assert_eq!(&got[..], &recs[..got.len()]);
    }

    #[test]
    fn resync_loses_exactly_the_damaged_record(seed_keys in proptest::collection::vec("[a-f0-9]{1,70}", 1..8),
                                               flip in any::<usize>(), width in 1usize..6) {
        let recs: Vec<Record> = seed_keys.iter().enumerate().map(|(i, k)| if i % 3 == 2 {
            Record::Del { key: k.clone() } } else { Record::Put {
            key: k.clone(), at: Placement::new(4096, i as u32, 10, i as u32), } }).collect();
        let mut buf = Vec::new();
        let mut starts = Vec::new();
        for r in &recs { starts.push(buf.len()); r.encode(&mut buf); }
        // damage `width` bytes inside one record (hex keys cannot hold a magic, so no false record)
        let i = flip % buf.len();
        let hit = starts.iter().rposition(|&s| s <= i).unwrap();
        let end = if hit + 1 < starts.len() { starts[hit + 1] } else { buf.len() };
        for b in &mut buf[i..(i + width).min(end)] { *b ^= 0xa5; }
        let p = parse_resync(&buf);
        let mut want = recs.clone();
        want.remove(hit);
        prop_assert_eq!(&p.records, &want);
        // replay's reading: the same records at their offsets, the same damage and end
        let o = parse_resync_with(&buf, |_, off| off);
        let at: Vec<Record> = o.records.iter().map(|&off| record_at(&buf, off).to_record()).collect();
        prop_assert_eq!((&at, &o.damaged, o.valid_end), (&p.records, &p.damaged, p.valid_end));
        for (&off, r) in o.records.iter().zip(&p.records) {
            let (Record::Put { key, .. } | Record::Del { key }) = r;
            prop_assert_eq!(key_bytes_at(&buf, off), key.as_bytes());
        }
        if hit + 1 < recs.len() {
            prop_assert_eq!(p.damaged.clone(), vec![(starts[hit], end - starts[hit])]);
            prop_assert_eq!(p.valid_end, buf.len());
        } else {
            prop_assert!(p.damaged.is_empty());
            prop_assert_eq!(p.valid_end, starts[hit]); // the last record damaged: a torn tail
        }
    }
}

/// docs/STORE.md's record layout table is the one [`layout::table`] makes from the constants the encoder
/// and the parser use; `KVTIER_WRITE_DOCS=1` writes it into the document instead of comparing.
#[test]
fn store_md_layout_table_is_the_layout() {
    const START: &str = "<!-- journal record layout:";
    const END: &str = "<!-- end of the journal record layout -->";
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/STORE.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let open = doc.find(START).expect("STORE.md marks the record layout");
    let body = open + doc[open..].find("-->\n").expect("the start marker's end") + 4;
    let end = body
        + doc[body..]
            .find(END)
            .expect("STORE.md marks the layout's end");
    let want = format!("\n{}\n", layout::table());
    if std::env::var_os("KVTIER_WRITE_DOCS").is_some() {
        std::fs::write(path, format!("{}{want}{}", &doc[..body], &doc[end..])).unwrap();
        return;
    }
    assert_eq!(
        &doc[body..end],
        want,
        "docs/STORE.md's record layout differs from store::journal::layout (KVTIER_WRITE_DOCS=1 writes it)"
    );
}

/// The layout's offsets are where the encoder puts each field.
#[test]
fn layout_offsets_are_where_records_are_encoded() {
    let at = Placement::new(0x0102_0304, 0x0506_0708, 0x1112_1314_1516_1718, 0x2122_2324)
        .with_seal(Some([0xAB; SEAL_LEN]))
        .with_coded(Some(0x3132_3334_3536_3738));
    let mut e = Vec::new();
    encode_put(&mut e, "key", &at);
    let field = |f: layout::Field| &e[f.range()];
    assert_eq!(field(layout::MAGIC_FIELD), MAGIC.to_le_bytes());
    assert_eq!(field(layout::KIND), [layout::CODED_SEALED_PUT]);
    assert_eq!(field(layout::KEY_LEN), 3u16.to_le_bytes());
    assert_eq!(field(layout::CLASS), at.class.to_le_bytes());
    assert_eq!(field(layout::SLOT), at.slot.to_le_bytes());
    assert_eq!(field(layout::LEN), at.len.to_le_bytes());
    assert_eq!(field(layout::CRC), at.crc.to_le_bytes());
    let parts = PutParts::of(&at);
    assert_eq!(parts, PutParts::CODED.with(PutParts::SEALED, true));
    let decoded = parts.at(PutParts::CODED);
    assert_eq!(
        e[decoded..decoded + 8],
        0x3132_3334_3536_3738u64.to_le_bytes()
    );
    let seal = parts.at(PutParts::SEALED);
    assert_eq!(e[seal..seal + SEAL_LEN], [0xAB; SEAL_LEN]);
    let key = layout::key_at(layout::CODED_SEALED_PUT);
    assert_eq!(&e[key..key + 3], b"key");
    assert_eq!(e.len(), layout::record_len(layout::CODED_SEALED_PUT, 3));
    assert_eq!(e.len(), put_len(3, parts));
}

/// Every combination of optional parts has exactly one put kind ([`layout::KINDS`]), which reads back as
/// those parts; no two kinds share a byte; the longest put carries them all.
#[test]
fn every_combination_of_parts_has_one_kind() {
    let mut bytes: Vec<u8> = layout::KINDS.iter().map(|k| k.kind).collect();
    bytes.sort_unstable();
    bytes.dedup();
    assert_eq!(bytes.len(), layout::KINDS.len(), "a kind byte used twice");
    let n = layout::PARTS.len();
    for combo in 0..1u32 << n {
        let parts = (0..n).fold(PutParts::NONE, |p, i| {
            p.with(layout::PARTS[i].bit, combo & (1 << i) != 0)
        });
        let with: Vec<_> = layout::KINDS
            .iter()
            .filter(|k| k.put == Some(parts))
            .collect();
        assert_eq!(with.len(), 1, "{parts:?}: one kind");
        assert_eq!(layout::parts_of(layout::put_kind(parts)), Some(parts));
        assert!(put_len(0, parts) <= put_len(0, PutParts::ALL));
    }
    assert_eq!(
        layout::KINDS.len(),
        (1 << n) + 1,
        "the put kinds and the del"
    );
    assert_eq!(layout::parts_of(layout::DEL), None);
    assert_eq!(layout::key_at(layout::DEL), FIXED);
}
