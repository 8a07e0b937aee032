use super::*;
use crate::cuda::Kernel;
use crate::plan::Layout;

fn request(
    region: Arc<HostRegion>,
    device: &mut [Vec<u8>],
    h: Vec<i64>,
    d: Vec<i64>,
    to_host: bool,
) -> PlanRequest {
    // page_first_direct, 2 layers, 4 slots of 2-token pages, 8-byte rows
    let geo = HostGeometry::new(Layout::PageFirstDirect, 2, 4, 2, 8).unwrap();
    PlanRequest {
        geo,
        region,
        host_offset: 0,
        device: device
            .iter_mut()
            .map(|v| RawRange {
                ptr: v.as_mut_ptr() as usize,
                len: v.len(),
            })
            .collect(),
        cuda: false,
        host_indices: h,
        device_indices: d,
        rules: IndexRules {
            host_slots: 4,
            device_rows: 6,
            page_size: 2,
            host_pages: true,
            device_runs: true,
            destination_is_host: to_host,
        },
        layers: 0..2,
        dir: if to_host {
            Direction::DeviceToHost
        } else {
            Direction::HostToDevice
        },
        split: usize::MAX,
    }
}

#[test]
fn plan_round_trip_on_cpu_and_bad_input_is_refused_before_a_byte_moves() {
    let region = Arc::new(HostRegion::new(4096, &Default::default()).unwrap());
    let mut device: Vec<Vec<u8>> = (0..2u8)
        .map(|l| (0..48).map(|i| i ^ (l * 100)).collect())
        .collect();
    let orig = device.clone();
    let backup = Plan::new(request(
        region.clone(),
        &mut device,
        vec![2, 3],
        vec![4, 5],
        true,
    ))
    .unwrap();
    // SAFETY: `device` is live CPU memory disjoint from the region for the whole call.
    unsafe { backup.copy_cpu(0, 2).unwrap() };
    for v in device.iter_mut() {
        v.fill(0);
    }
    let load = Plan::new(request(
        region.clone(),
        &mut device,
        vec![2, 3],
        vec![0, 1],
        false,
    ))
    .unwrap();
    // SAFETY: as above.
    unsafe { load.copy_cpu(0, 2).unwrap() };
    for l in 0..2 {
        assert_eq!(&device[l][0..16], &orig[l][32..48]);
        assert!(device[l][16..].iter().all(|&b| b == 0));
    }
    assert!(load.slice(1, 3).is_err() && load.slice(1, 1).is_err() && load.slice(0, 1).is_ok());
    // a host slot past the pool, a layer range past the tensors: refused at planning
    assert!(Plan::new(request(
        region.clone(),
        &mut device,
        vec![6, 7],
        vec![0, 1],
        false
    ))
    .is_err());
    let mut r = request(region.clone(), &mut device, vec![0, 1], vec![0, 1], false);
    r.layers = 0..3;
    assert!(Plan::new(r).is_err());
    // a plan for CPU memory is never handed to the copy engine
    let err = submit_layers(&[&load], 0, 2, 0, 7, &[], true, true, &[]).unwrap_err();
    assert!(err.to_string().contains("CPU tensors"), "{err}");
}

#[test]
fn plan_and_run_copies_once_planned_and_nothing_when_a_side_is_refused() {
    let region = Arc::new(HostRegion::new(4096, &Default::default()).unwrap());
    let mut device: Vec<Vec<u8>> = (0..2u8)
        .map(|l| (0..48).map(|i| i ^ (l * 100)).collect())
        .collect();
    let orig = device.clone();
    let reqs = vec![request(
        region.clone(),
        &mut device,
        vec![2, 3],
        vec![4, 5],
        true,
    )];
    // SAFETY: `device` is live CPU memory disjoint from the region for the whole call.
    let (plans, counts) = unsafe { plan_and_run(reqs, Run::Cpu { layers: 0..2 }) }.unwrap();
    assert_eq!((plans.len(), counts), (1, (0, 0)));
    for v in device.iter_mut() {
        v.fill(0);
    }
    // the returned plan is reusable: a load through a second call copies the bytes back
    let reqs = vec![request(
        region.clone(),
        &mut device,
        vec![2, 3],
        vec![0, 1],
        false,
    )];
    // SAFETY: as above.
    let (load, _) = unsafe { plan_and_run(reqs, Run::Cpu { layers: 0..1 }) }.unwrap();
    assert_eq!(&device[0][0..16], &orig[0][32..48]);
    assert!(
        device[1].iter().all(|&b| b == 0),
        "only the layers asked for are copied"
    );
    // SAFETY: as above.
    unsafe { load[0].copy_cpu(1, 2).unwrap() };
    assert_eq!(&device[1][0..16], &orig[1][32..48]);
    // the second side's device rows are out of range: no side is copied
    let before = device.clone();
    let good = request(region.clone(), &mut device, vec![0, 1], vec![0, 1], false);
    let mut bad = request(region.clone(), &mut device, vec![0, 1], vec![0, 1], false);
    bad.device_indices = vec![6, 7];
    // SAFETY: as above.
    assert!(unsafe { plan_and_run(vec![good, bad], Run::Cpu { layers: 0..2 }) }.is_err());
    assert_eq!(device, before);
    // CPU plans are never handed to the copy engine, planned or not
    let reqs = vec![request(
        region.clone(),
        &mut device,
        vec![0, 1],
        vec![0, 1],
        false,
    )];
    let run = Run::Cuda {
        layers: 0..2,
        device: 0,
        stream: 7,
        side_streams: &[],
        batch: true,
        per_layer: false,
        events: &[],
    };
    // SAFETY: refused before any submission (CPU plans).
    let err = unsafe { plan_and_run(reqs, run) }.err().unwrap();
    assert!(err.to_string().contains("CPU tensors"), "{err}");
}

#[test]
fn sides_are_validated_once_and_bad_input_still_refused() {
    let region = Arc::new(HostRegion::new(4096, &Default::default()).unwrap());
    let mut dev: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 48]).collect();
    let mut dev2 = dev.clone();
    let k = request(region.clone(), &mut dev, vec![0, 1], vec![2, 3], false);
    let mut v = request(region.clone(), &mut dev2, vec![0, 1], vec![2, 3], false);
    v.host_offset = 64;
    assert_eq!(Plan::new_sides(vec![k, v]).unwrap().len(), 2);
    // different indices per side: each validated, so a bad second side is refused
    let k = request(region.clone(), &mut dev, vec![0, 1], vec![2, 3], false);
    let v = request(region.clone(), &mut dev2, vec![0, 1], vec![3, 3], false); // not a page run
    assert!(Plan::new_sides(vec![k, v]).is_err());
    // duplicate destinations in the shared indices: refused by the one validation
    let k = request(
        region.clone(),
        &mut dev,
        vec![0, 1, 0, 1],
        vec![2, 3, 2, 3],
        false,
    );
    let v = request(region, &mut dev2, vec![0, 1, 0, 1], vec![2, 3, 2, 3], false);
    assert!(Plan::new_sides(vec![k, v]).is_err());
}

#[test]
fn streams_events_and_launches_are_checked() {
    assert!(groups::check_sides(5, &[6, 7]).is_ok());
    assert!(groups::check_sides(5, &[5]).is_err() && groups::check_sides(5, &[0]).is_err());
    assert!(groups::check_sides(5, &[6, 6]).is_err());
    assert!(groups::check_events(&[1, 2, 3, 4], 2, 2).is_ok());
    assert!(
        groups::check_events(&[1, 2, 3], 2, 2).is_err()
            && groups::check_events(&[1, 0], 1, 2).is_err()
    );
    let k = Kernel {
        function: 1,
        grid: 1,
        block: 32,
        shared: 0,
    };
    assert!(KernelLaunch::new(0, k, &[8, 4], &[1, 2], 1).is_ok());
    assert!(KernelLaunch::new(0, k, &[8, 4], &[1, 1 << 40], 1).is_err()); // does not fit 32 bits
    assert!(KernelLaunch::new(0, k, &[8, 4], &[1, 2], 0).is_err()); // the layer is a 32-bit parameter
    assert!(KernelLaunch::new(0, k, &[8, 2], &[1, 2], 0).is_err()); // width 2
    assert!(KernelLaunch::new(0, k, &[8], &[1, 2], 0).is_err()); // counts differ
}

#[test]
fn a_detour_submission_refuses_bad_streams_and_events_before_any_cuda_call() {
    // (no plan reaches the driver: the arguments are refused first, on a machine without CUDA too)
    let cases = [
        (7usize, 0usize, 8usize, 9usize, "detour"),
        (5, 5, 8, 9, "detour"),
        (5, 6, 0, 9, "fork/join"),
        (5, 6, 8, 0, "fork/join"),
        (5, 6, 8, 8, "fork/join"),
    ];
    for (caller, detour, fork, join, arg) in cases {
        let err = super::submit_layers_detour(&[], 0, 1, 0, caller, detour, fork, join, true, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains(arg), "{caller} {detour} {fork} {join}: {err}");
    }
}

#[test]
fn a_gate_that_cannot_be_enqueued_holds_what_follows_until_it_opens() {
    use crate::cuda::HostGate;
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let nowhere = i32::MAX; // no such device: no gate can be enqueued there
    let first = Arc::new(HostGate::new());
    let s1 = submit_gate_background(nowhere, 0, first.clone(), None).unwrap();
    let open = Arc::new(HostGate::new());
    open.open();
    let s2 = submit_gate_background(nowhere, 0, open.clone(), Some(&s1)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !s1.finished() && !s2.finished(),
        "a submission after a gate that was never enqueued went ahead before the gate opened"
    );
    first.open();
    assert!(s1.join().is_err(), "the failed gate must report its error");
    assert!(s2.join().is_err());
    // a gate no one else holds can never be opened: its submission ends instead of waiting forever
    let t = Instant::now();
    let s3 = submit_gate_background(nowhere, 0, Arc::new(HostGate::new()), None).unwrap();
    assert!(s3.join().is_err());
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}
