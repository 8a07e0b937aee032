"""The guards in front of the kernel backend's native launches (no GPU needed): the check of a compiled
variant's parameter list read from its PTX, which decides whether kvtier may launch it with
cuLaunchKernel instead of Triton's launcher, and the 32-bit work-count guard."""

from types import SimpleNamespace

import pytest
import torch

from kvtier.transfer import kernels

POINTER = ".param .u64 .ptr .global .align 1 _rows_kernel_param_{i}"
INT = ".param .u32 _rows_kernel_param_{i}"


def ptx(params, entries=1, body="ld.global.v2.b64 %rd1, [%rd2];\n st.global.v2.b64 [%rd3], %rd1;"):
    header = ",\n".join(p.format(i=i) for i, p in enumerate(params))
    entry = f".visible .entry _rows_kernel(\n{header}\n)\n.reqntid 256\n{{\n {body}\n}}\n"
    return ".version 8.7\n.target sm_90a\n" + entry * entries


GOOD = [POINTER] * 5 + [INT] * 7 + [POINTER] * 2  # 5 pointers, 7 ints, global + profile scratch


def compiled(params=GOOD, entries=1, function=0x1234, **md):
    meta = dict(num_warps=8, shared=0, num_ctas=1)
    meta.update(md)
    return SimpleNamespace(metadata=SimpleNamespace(**meta), asm={"ptx": ptx(params, entries)}, function=function, n_regs=40)


def test_the_expected_parameter_list_launches_natively():
    abi = kernels._abi_of(compiled())
    assert abi.function == 0x1234 and not abi.reason
    assert abi.widths == (8,) * 5 + (4,) * 7 + (8, 8)
    assert abi.block == 256 and abi.shared == 0 and abi.registers == 40
    assert "ld.global.v2.b64" in abi.memory_ops
    # without scratch pointers (older Triton) too
    assert kernels._abi_of(compiled(params=GOOD[:12])).function == 0x1234


@pytest.mark.parametrize(
    "case, params, md",
    [
        ("an int passed as 64 bits", [POINTER] * 5 + [INT] * 6 + [".param .u64 _rows_kernel_param_{i}"] + [POINTER] * 2, {}),
        ("a parameter of another kind", GOOD + [".param .align 8 .b8 _rows_kernel_param_{i}[16]"], {}),
        ("three trailing pointers", GOOD + [POINTER], {}),
        ("a missing parameter", GOOD[:11], {}),
        ("global scratch memory", GOOD, {"global_scratch_size": 256}),
        ("programmatic dependent launch", GOOD, {"launch_pdl": True}),
        ("a cluster launch", GOOD, {"num_ctas": 2}),
    ],
)
def test_anything_else_stays_on_tritons_launcher(case, params, md):
    abi = kernels._abi_of(compiled(params=params, **md))
    assert abi.function == 0 and abi.reason, case


def test_no_handle_or_two_entries_stay_on_tritons_launcher():
    assert kernels._abi_of(compiled(function=0)).function == 0
    assert kernels._abi_of(compiled(entries=2)).function == 0
    assert kernels._abi_of(SimpleNamespace()).reason  # not a compiled kernel at all


def test_a_launch_whose_work_count_overflows_32_bits_is_refused_before_it_runs():
    t = torch.zeros(4, dtype=torch.int64)
    consts = dict(ROW_WORDS=192, TO_HOST=False, BLOCK_T=32, BLOCK_W=64, ALIGN=64, PREFETCH=True)
    huge = kernels.RowsLaunch(t, t, t, t, t, (1 << 30, 48 * 64, 48, 1, 64), consts, 16, 8, ("test",), 48)
    with pytest.raises(ValueError, match="too many"):
        kernels.run_rows([huge], 0, 48, per_layer=False)
    with pytest.raises(ValueError, match="too many"):
        kernels.run_rows([huge], 0, 48, per_layer=True, events=[[object()]] * 48)


def test_a_launch_that_overflows_only_over_all_layers_runs_layer_by_layer(monkeypatch):
    # n_tok * sub-rows fits 32 bits for one layer but not for 48: an all-layer launch is split per layer
    t = torch.zeros(4, dtype=torch.int64)
    consts = dict(ROW_WORDS=192, TO_HOST=False, BLOCK_T=32, BLOCK_W=64, ALIGN=64, PREFETCH=True)
    n_tok = (1 << 31) // 3 // 8  # x 3 sub-rows: under 2^31 for one layer, over it for 48
    x = kernels.RowsLaunch(t, t, t, t, t, (n_tok, 48 * 64, 48, 1, 64), consts, 16, 8, ("test",), 48)
    calls = []
    monkeypatch.setattr(kernels.RowsLaunch, "run_triton", lambda self, layer, n: calls.append((layer, n)))
    kernels.run_rows([x], 0, 48, per_layer=False)
    assert calls == [(layer, 1) for layer in range(48)]


def test_a_partial_page_is_refused_where_the_layout_addresses_whole_pages():
    """Only a page_first staging run may hold a partial page (its strides do not depend on the slot count);
    layer_first and page_first_direct would address rows past the buffer (review finding)."""
    host = torch.zeros(10, 16, dtype=torch.uint8)
    dev = [torch.zeros(8, 16, dtype=torch.uint8) for _ in range(2)]
    idx = torch.arange(5)
    for layout in ("layer_first", "page_first_direct"):
        with pytest.raises(ValueError, match="slots"):
            kernels.prepare_rows(host=host, layout=layout, slots=5, layers=2, page_size=4, row_bytes=16,
                                 device_layers=dev, host_idx=idx, dev_idx=idx, to_host=False, blocks=1, num_warps=4)
    x = kernels.prepare_rows(host=host, layout="page_first", slots=5, layers=2, page_size=4, row_bytes=16,
                             device_layers=dev, host_idx=idx, dev_idx=idx, to_host=False, blocks=1, num_warps=4)
    assert x.ints[1:4] == (8, 2, 1) and not x.consts["PAGED"]  # rows: page 4 tokens x 2 layers, token 2, layer 1
