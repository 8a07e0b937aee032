//! One stored object as the index holds it: where it lives, how to check it, its place in the LRU order and
//! its pins, its seal and, for a coded object, what it decodes to.

use std::num::NonZeroU64;

use crate::seal::Seal;
use crate::store::journal::Placement;

/// One stored object.
#[derive(Clone, Debug)]
pub(in crate::store) struct Entry {
    pub(in crate::store) class: u32,
    pub(in crate::store) slot: u32,
    pub(in crate::store) len: u64,
    pub(in crate::store) crc: u32,
    pub(in crate::store) tick: u64,
    pub(in crate::store) pins: u32,
    /// Unique per insert: a key re-put into the same slot is another object (set by [`Index::insert`]).
    pub(in crate::store) gen: u64,
    /// Failed its checksum and could not be dropped durably: never served, slot never reused; a put of
    /// the key writes a new slot that supersedes it.
    pub(in crate::store) bad: bool,
    /// Nonce and tag of an object sealed at rest (boxed: clear stores pay one pointer).
    pub(in crate::store) seal: Option<Box<Seal>>,
    /// The length a coded object decodes to (`len` is then the stored length); `None`: stored as given.
    pub(in crate::store) coded: Option<NonZeroU64>,
}

impl From<Placement> for Entry {
    /// A new entry where a put record says its object lives.
    fn from(at: Placement) -> Self {
        let mut e = Entry::new(at.class, at.slot, at.len, at.crc).sealed(at.seal);
        e.coded = at.coded.and_then(NonZeroU64::new);
        e
    }
}

impl Entry {
    pub(in crate::store) fn new(class: u32, slot: u32, len: u64, crc: u32) -> Self {
        Self {
            class,
            slot,
            len,
            crc,
            tick: 0,
            pins: 0,
            gen: 0,
            bad: false,
            seal: None,
            coded: None,
        }
    }

    /// What a put record of this entry carries (compaction writes it again).
    pub(in crate::store) fn placement(&self) -> Placement {
        Placement {
            class: self.class,
            slot: self.slot,
            len: self.len,
            crc: self.crc,
            seal: self.seal.as_deref().copied(),
            coded: self.coded.map(NonZeroU64::get),
        }
    }

    /// The length a reader gets: what a coded object decodes to, else the stored length.
    pub(in crate::store) fn decoded_len(&self) -> u64 {
        self.coded.map_or(self.len, NonZeroU64::get)
    }

    /// The entry with its seal (`None`: stored in clear).
    pub(in crate::store) fn sealed(mut self, seal: Option<Seal>) -> Self {
        self.seal = seal.map(Box::new);
        self
    }

    /// Whether this entry may be served (and counts as stored).
    pub(in crate::store) fn servable(&self) -> bool {
        !self.bad
    }
}
