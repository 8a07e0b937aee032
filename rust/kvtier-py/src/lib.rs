//! `kvtier._native`: the pyo3 binding of `kvtier-core`. Registration only; conversions live in one file
//! per core module, the public API in `python/kvtier`.

// The integrity bench's flag (benches/integrity_ab.sh) turns the object checksum off; no module may carry it.
#[cfg(kvtier_bench_unverified)]
compile_error!("kvtier-py must not be built with --cfg kvtier_bench_unverified (a bench-only build without checksums)");

mod buffer;
mod codec;
mod dlpack;
mod engine;
mod errors;
mod exit;
mod plans;
mod ranges;
mod seal;
mod store;
mod store_batches;
mod store_fns;
mod transfer;

use pyo3::prelude::*;

/// The private native module; import `kvtier` instead.
#[pymodule(gil_used = false)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<buffer::PyHostRegion>()?;
    m.add_class::<buffer::PyProgress>()?;
    m.add_class::<transfer::PyPageAllocator>()?;
    m.add_class::<plans::PyTransferPlan>()?;
    m.add_class::<store::PyPageStore>()?;
    m.add_class::<ranges::PyHostRanges>()?;
    m.add_class::<seal::PyKeyring>()?;
    m.add_function(wrap_pyfunction!(seal::tenant_tag, m)?)?;
    m.add_function(wrap_pyfunction!(seal::tenant_keys, m)?)?;
    m.add_function(wrap_pyfunction!(seal::tenant_of, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::namespace_dir, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::store_namespaces, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::remove_namespace, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::store_budget, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::set_store_budget, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::store_format_version, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::page_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(codec::codec_encode, m)?)?;
    m.add_function(wrap_pyfunction!(codec::codec_decode, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::disk_roofline, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::fault_set, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::fault_clear, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::fault_points, m)?)?;
    m.add_function(wrap_pyfunction!(store_fns::fault_hits, m)?)?;
    m.add_function(wrap_pyfunction!(buffer::cuda_host_registered, m)?)?;
    m.add_function(wrap_pyfunction!(buffer::cuda_driver_available, m)?)?;
    m.add_function(wrap_pyfunction!(transfer::validate_transfer, m)?)?;
    m.add_function(wrap_pyfunction!(plans::plan_sides, m)?)?;
    m.add_function(wrap_pyfunction!(engine::copy_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(transfer::page_numbers, m)?)?;
    m.add_function(wrap_pyfunction!(transfer::host_layout, m)?)?;
    m.add_function(wrap_pyfunction!(transfer::page_extents, m)?)?;
    m.add_function(wrap_pyfunction!(transfer::cuda_batch_supported, m)?)?;
    m.add_function(wrap_pyfunction!(engine::cuda_batch_flags, m)?)?;
    m.add_function(wrap_pyfunction!(engine::cuda_set_batch_limit, m)?)?;
    m.add_function(wrap_pyfunction!(engine::submit_layers, m)?)?;
    m.add_function(wrap_pyfunction!(engine::submit_layers_detour, m)?)?;
    m.add_function(wrap_pyfunction!(engine::submit_layers_background, m)?)?;
    m.add_class::<engine::PySubmission>()?;
    m.add_function(wrap_pyfunction!(engine::submit_gate_background, m)?)?;
    m.add_class::<engine::PyHostGate>()?;
    m.add_class::<exit::PyPendingIo>()?;
    m.add_function(wrap_pyfunction!(engine::launch_layers, m)?)?;
    m.add("SEAL_LEN", kvtier_core::seal::SEAL_LEN)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
