//! Index validation: every token-slot index of a transfer checked against its rules before anything is
//! planned.

use crate::error::{Error, Result};

/// Index rules of one transfer call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexRules {
    /// Host slots `S`.
    pub host_slots: usize,
    /// Rows of each device layer tensor.
    pub device_rows: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Host indices must be whole pages (page-start multiple of `page_size`, consecutive inside a page).
    pub host_pages: bool,
    /// Device indices must come in consecutive runs of `page_size`, and lengths must be page multiples.
    pub device_runs: bool,
    /// Which side is written: its indices must be distinct (two writes to one row would race).
    pub destination_is_host: bool,
}

fn check_range(name: &str, idx: &[i64], limit: usize) -> Result<()> {
    for (i, &v) in idx.iter().enumerate() {
        if v < 0 || v as u64 >= limit as u64 {
            return Err(Error::arg(
                name,
                format!("{name}[{i}] = {v} is out of range [0, {limit})"),
            ));
        }
    }
    Ok(())
}

fn check_distinct(name: &str, idx: &[i64], limit: usize) -> Result<()> {
    let mut seen = vec![0u64; limit.div_ceil(64)];
    for (i, &v) in idx.iter().enumerate() {
        let v = v as usize; // in range: checked before
        let (w, b) = (v / 64, 1u64 << (v % 64));
        if seen[w] & b != 0 {
            return Err(Error::arg(
                name,
                format!("{name}[{i}] = {v} appears twice; a destination slot can be written once per call"),
            ));
        }
        seen[w] |= b;
    }
    Ok(())
}

/// Validates a transfer's index lists against `rules`. Nothing may be copied unless this returned Ok.
pub fn validate(host: &[i64], device: &[i64], rules: &IndexRules) -> Result<()> {
    if host.len() != device.len() {
        return Err(Error::arg(
            "device_indices",
            format!(
                "host_indices and device_indices must have the same length, got {} and {}",
                host.len(),
                device.len()
            ),
        ));
    }
    let ps = rules.page_size;
    check_range("host_indices", host, rules.host_slots)?;
    check_range("device_indices", device, rules.device_rows)?;
    if rules.host_pages {
        crate::alloc::page_starts(host, ps, rules.host_slots / ps, "host_indices")?;
    }
    if rules.device_runs {
        if !device.len().is_multiple_of(ps) {
            return Err(Error::arg(
                "device_indices",
                format!(
                    "length {} is not a multiple of page_size {ps}",
                    device.len()
                ),
            ));
        }
        for (g, grp) in device.chunks_exact(ps).enumerate() {
            for (k, &v) in grp.iter().enumerate() {
                if v != grp[0] + k as i64 {
                    return Err(Error::arg(
                        "device_indices",
                        format!(
                            "device_indices[{}] = {v}: each page's {ps} device slots must be consecutive",
                            g * ps + k
                        ),
                    ));
                }
            }
        }
    }
    if rules.destination_is_host {
        check_distinct("host_indices", host, rules.host_slots)
    } else {
        check_distinct("device_indices", device, rules.device_rows)
    }
}
