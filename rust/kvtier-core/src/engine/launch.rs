//! Compiled-kernel launches, layer by layer, on the caller's stream and its lanes.

use super::groups::{check_events, check_sides, run_groups, Group};
use crate::cuda::{Kernel, Param};
use crate::{Error, Result};

/// One kernel launch of a transfer: the kernel, its parameters, and which parameter is the layer.
pub struct KernelLaunch {
    kernel: Kernel,
    params: Vec<Param>,
    layer_param: usize,
}

impl KernelLaunch {
    /// From raw parts: `widths[i]` (4 or 8) is the byte width of parameter i, `values[i]` its value (checked
    /// to fit); `layer_param` is the index of a 32-bit parameter set to the layer of each launch.
    pub fn new(
        index: usize,
        kernel: Kernel,
        widths: &[u8],
        values: &[u64],
        layer_param: usize,
    ) -> Result<Self> {
        if widths.len() != values.len() || layer_param >= widths.len() || widths[layer_param] != 4 {
            return Err(Error::arg(
                "launches",
                format!(
                    "launch {index}: {} widths, {} values, layer parameter {layer_param}",
                    widths.len(),
                    values.len()
                ),
            ));
        }
        let mut params = Vec::with_capacity(values.len());
        for (j, (&w, &v)) in widths.iter().zip(values).enumerate() {
            params.push(match w {
                4 => Param::U32(u32::try_from(v).map_err(|_| {
                    Error::arg(
                        "launches",
                        format!("launch {index} parameter {j}: {v} does not fit 32 bits"),
                    )
                })?),
                8 => Param::U64(v),
                _ => {
                    return Err(Error::arg(
                        "launches",
                        format!("launch {index} parameter {j}: width {w} is not 4 or 8"),
                    ))
                }
            });
        }
        Ok(KernelLaunch {
            kernel,
            params,
            layer_param,
        })
    }
}

/// Enqueues `launches` for layers `[layer_begin, layer_end)`: for each layer, every launch with its layer
/// parameter set to the layer (launch i on lane i mod (1 + `side_streams`)), then the layer's events, one
/// per lane (when given); `mark` (an event, 0 = none) is recorded on `stream` after the lanes have joined
/// back into it, so it follows every launch.
///
/// # Safety
/// Every launch's function must be loaded in `device`'s primary context, with the parameter list its
/// compiled code expects, and every address among the parameters must point to memory that is valid for the
/// kernel and stays alive until `stream` has passed the launches. Streams and events must be live on
/// `device`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_layers(
    device: i32,
    stream: usize,
    side_streams: &[usize],
    mut launches: Vec<KernelLaunch>,
    layer_begin: usize,
    layer_end: usize,
    events: &[usize],
    mark: usize,
) -> Result<()> {
    check_sides(stream, side_streams)?;
    let n_groups = layer_end.saturating_sub(layer_begin);
    let lanes = 1 + side_streams.len();
    check_events(events, n_groups, lanes)?;
    if layer_end > u32::MAX as usize {
        return Err(Error::arg("layer_end", format!("too large: {layer_end}")));
    }
    let mut groups: Vec<Group<(u32, usize)>> = (0..n_groups)
        .map(|g| Group {
            parts: (0..launches.len())
                .map(|i| ((layer_begin + g) as u32, i))
                .collect(),
            events: if events.is_empty() {
                Vec::new()
            } else {
                events[g * lanes..(g + 1) * lanes].to_vec()
            },
        })
        .collect();
    run_groups(
        device,
        stream,
        side_streams,
        0,
        mark,
        &mut groups,
        &|| {},
        |_, _| Ok(()),
        |cur, lane, &mut (layer, i)| {
            let l = &mut launches[i];
            l.params[l.layer_param] = Param::U32(layer);
            // the caller's contract (this function's safety section): a function of this context with its
            // compiled parameter list, addresses of live buffers.
            // SAFETY: upheld by the caller of launch_layers.
            unsafe { cur.launch(lane, &l.kernel, &l.params) }
        },
    )
}
