//! The journal as the store keeps it: appending records under the commit lock and the prepaid delete reserve
//! (`commit`), compaction in steps between commits (`compact`), eviction to the space's limits (`evict`),
//! replay at open (`recovery`, with its key interning `replay_keys`), a read-only store following its
//! writer's appends (`follow`), and the locks of the log's state in their one order (`locks`). The record format itself is `journal`.

pub(super) mod commit;
pub(super) mod compact;
pub(super) mod evict;
pub(super) mod follow;
pub(super) mod locks;
pub(super) mod recovery;
pub(super) mod replay_keys;
