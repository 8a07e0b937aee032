//! Holder crate for kvtier's criterion benches (`cargo bench -p kvtier-bench`); the benches live beside it.
