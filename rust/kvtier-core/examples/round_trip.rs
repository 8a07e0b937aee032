//! One page's round trip through the core, device side in CPU memory: backup (plan and copy in one call),
//! page store write and read, then a per-layer load (the first layer planned and copied in one call, the
//! others from the plans). Run under callgrind, it lists every kvtier function a page passes through
//! (docs/ARCHITECTURE.md, "One page's round trip"); run plainly, it checks the bytes came back.
//!
//!   cargo build --example round_trip -p kvtier-core
//!   valgrind --tool=callgrind --compress-strings=no --collect-atstart=no --toggle-collect='round_trip::round_trip' \
//!     --callgrind-out-file=cg.out target/debug/examples/round_trip
//!   python3 scripts/count_rust_functions.py cg.out
//!
//! The store runs with one IO thread here, so that every function runs on the thread callgrind follows.

use std::sync::Arc;

use kvtier_core::buffer::HostRegion;
use kvtier_core::engine::{plan_and_run, PlanRequest, Run};
use kvtier_core::plan::{Direction, HostGeometry, IndexRules, Layout, RawRange};
use kvtier_core::store::{PageBatch, PageLayout, PageStore, StoreOptions};

const LAYERS: usize = 4;
const PAGE: usize = 16;
const SLOTS: usize = 64;
const ROWS: usize = 64; // device rows per layer
const K_ROW: usize = 256; // bytes of one token of one layer
const V_ROW: usize = 128;

fn request(
    region: &Arc<HostRegion>,
    offset: usize,
    row: usize,
    device: &mut [Vec<u8>],
    to_host: bool,
) -> PlanRequest {
    PlanRequest {
        geo: HostGeometry::new(Layout::PageFirstDirect, LAYERS, SLOTS, PAGE, row).unwrap(),
        region: region.clone(),
        host_offset: offset,
        device: device
            .iter_mut()
            .map(|v| RawRange {
                ptr: v.as_mut_ptr() as usize,
                len: v.len(),
            })
            .collect(),
        cuda: false,
        host_indices: (16..32).collect(), // page 1
        device_indices: (32..48).collect(),
        rules: IndexRules {
            host_slots: SLOTS,
            device_rows: ROWS,
            page_size: PAGE,
            host_pages: true,
            device_runs: true,
            destination_is_host: to_host,
        },
        layers: 0..LAYERS,
        dir: if to_host {
            Direction::DeviceToHost
        } else {
            Direction::HostToDevice
        },
        split: usize::MAX,
    }
}

/// The measured part: backup, store write, store read (after the host copy is wiped), per-layer load (after
/// the device copy is wiped).
#[inline(never)]
fn round_trip(
    region: &Arc<HostRegion>,
    store: &PageStore,
    keys: &[String],
    idx: &[i64],
    k: &mut [Vec<u8>],
    v: &mut [Vec<u8>],
) {
    let k_bytes = SLOTS * LAYERS * K_ROW;
    // backup, GPU → host: one call plans K and V, validates the indices once and copies every layer
    let reqs = vec![
        request(region, 0, K_ROW, k, true),
        request(region, k_bytes, V_ROW, v, true),
    ];
    // SAFETY: `k` and `v` are live CPU memory, disjoint from the region, for the whole call.
    unsafe { plan_and_run(reqs, Run::Cpu { layers: 0..LAYERS }) }.unwrap();
    let batch = PageBatch {
        keys,
        host_indices: idx,
    };
    assert_eq!(store.put_pages(&batch).unwrap(), vec![true]);
    // SAFETY: nothing else reads or writes the region meanwhile.
    unsafe { std::ptr::write_bytes(region.as_ptr(), 0, region.len()) };
    assert_eq!(store.get_pages(&batch).unwrap(), vec![true]);
    // load, host → GPU, layer by layer: the first layer plans and copies in one call, the others reuse the plans
    for t in k.iter_mut().chain(v.iter_mut()) {
        t.fill(0);
    }
    let reqs = vec![
        request(region, 0, K_ROW, k, false),
        request(region, k_bytes, V_ROW, v, false),
    ];
    // SAFETY: as for the backup.
    let (plans, _) = unsafe { plan_and_run(reqs, Run::Cpu { layers: 0..1 }) }.unwrap();
    for layer in 1..LAYERS {
        for p in &plans {
            // SAFETY: as for the backup.
            unsafe { p.copy_cpu(layer, layer + 1) }.unwrap();
        }
    }
}

fn main() {
    let (k_bytes, v_bytes) = (SLOTS * LAYERS * K_ROW, SLOTS * LAYERS * V_ROW);
    let region = Arc::new(HostRegion::new(k_bytes + v_bytes, &Default::default()).unwrap());
    let mut k: Vec<Vec<u8>> = (0..LAYERS)
        .map(|l| (0..ROWS * K_ROW).map(|i| (i * 7 + l) as u8).collect())
        .collect();
    let mut v: Vec<Vec<u8>> = (0..LAYERS)
        .map(|l| (0..ROWS * V_ROW).map(|i| (i * 5 + l) as u8).collect())
        .collect();
    let (k0, v0) = (k.clone(), v.clone());
    // host → disk → host
    let dir = std::env::temp_dir().join(format!("kvtier-round-trip-{}", std::process::id()));
    let store = PageStore::open(
        &dir,
        "ns",
        StoreOptions {
            capacity_bytes: 1 << 26,
            budget_bytes: None,
            io_threads: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let base = region.as_ptr() as usize;
    let layout = PageLayout {
        k_base: base,
        k_stride: PAGE * LAYERS * K_ROW,
        k_len: (PAGE * LAYERS * K_ROW) as u64,
        v_base: base + k_bytes,
        v_stride: PAGE * LAYERS * V_ROW,
        v_len: (PAGE * LAYERS * V_ROW) as u64,
        page_tokens: PAGE,
        pages: SLOTS / PAGE,
    };
    // SAFETY: every page's K and V lie inside `region`, alive until the end of main.
    unsafe { store.bind_pages(layout) }.unwrap();
    let keys = vec!["page".to_string()];
    let idx: Vec<i64> = (16..32).collect();
    round_trip(&region, &store, &keys, &idx, &mut k, &mut v);
    for l in 0..LAYERS {
        assert_eq!(k[l][32 * K_ROW..48 * K_ROW], k0[l][32 * K_ROW..48 * K_ROW]);
        assert_eq!(v[l][32 * V_ROW..48 * V_ROW], v0[l][32 * V_ROW..48 * V_ROW]);
    }
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
    println!("round trip: page 1 restored byte for byte");
}
