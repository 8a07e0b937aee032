"""kvtier's stand-in for sgl_kernel (benches/python/sgl_kernel_standin), which sglang_controller.py's --device cuda
mode puts on sys.path where the compiled sgl_kernel does not import: its direct ops move exactly the bytes
sgl_kernel's do (whole pages, page_first_direct host tensors of (page, layer, row, ...), device buffers of rows),
both ways, for MHA (K and V), MLA (one tensor) and asymmetric K/V dims, with host and device pages out of order; it
has every name SGLang's host pools import from sgl_kernel.kvcacheio on CUDA, the kernel ops among them raising. CPU
tensors only: the ops are Tensor.copy_ calls, the same on either device. The package is loaded under a private name,
never as ``sgl_kernel`` (other tests' SGLang imports must not find it)."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

STANDIN = Path(__file__).resolve().parent.parent / "benches" / "python" / "sgl_kernel_standin" / "sgl_kernel"
PS = 4  # tokens per page


def _load():
    name = "kvtier_test_sgl_kernel_standin"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, STANDIN / "__init__.py", submodule_search_locations=[str(STANDIN)]
        )
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[name] = pkg
        spec.loader.exec_module(pkg)
    return sys.modules[name]


pkg = _load()
io = pkg.kvcacheio


def rand(*shape, dtype=torch.bfloat16, seed=0):
    """Random bytes as ``dtype`` (NaN patterns included: compared as bytes)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).view(shape)


def same(a, b) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rows(pages):
    """Token indices of whole pages, in the given page order."""
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])


def device_layers(n_layers, row_shape, seed):
    return [rand(9 * PS, *row_shape, seed=seed + i) for i in range(n_layers)]  # 9 device pages of rows


def host_tensor(n_layers, row_shape):
    return torch.zeros(8, n_layers, PS, *row_shape, dtype=torch.bfloat16)  # 8 host pages


DEV_PAGES, HOST_PAGES = [5, 2, 7], [6, 1, 3]  # shuffled device pages; non-consecutive host pages
LOAD_PAGES = [8, 3, 1]  # where the load puts them back


@pytest.mark.parametrize(
    "shape", [{"k": (2, 8), "v": (2, 8)}, {"k": (2, 12), "v": (2, 8)}, {"kv": (1, 20)}], ids=["mha", "asym", "mla"]
)
def test_a_backup_and_a_load_move_exactly_each_page_both_ways(shape):
    """SGLang's calls: MHA passes K and V together (src: every layer's K then V); the asymmetric pool and MLA one
    tensor at a time (a lone host tensor)."""
    layers = 3
    parts = {name: device_layers(layers, row, seed=10 * i) for i, (name, row) in enumerate(shape.items())}
    hosts = {name: host_tensor(layers, row) for name, row in shape.items()}
    together = list(shape) == ["k", "v"] and shape["k"] == shape["v"]
    groups = [list(shape)] if together else [[name] for name in shape]
    src, dst = rows(DEV_PAGES), rows(HOST_PAGES)
    for g in groups:  # device -> host, every layer
        io.transfer_kv_all_layer_direct_lf_pf(
            src_ptrs=[t for n in g for t in parts[n]],
            dst_ptrs=[hosts[n] for n in g],
            src_indices=src,
            dst_indices=dst,
            page_size=PS,
        )
    for name, host in hosts.items():
        for d, h in zip(DEV_PAGES, HOST_PAGES):
            for layer in range(layers):
                assert same(host[h, layer], parts[name][layer][d * PS : (d + 1) * PS])
        untouched = [p for p in range(host.shape[0]) if p not in HOST_PAGES]
        assert not host[untouched].view(torch.uint8).any()
    fresh = {name: [torch.zeros_like(t) for t in ts] for name, ts in parts.items()}
    src, dst = rows(HOST_PAGES), rows(LOAD_PAGES)
    for layer in range(layers):  # host -> device, layer by layer (as SGLang's load stream does)
        for g in groups:
            io.transfer_kv_per_layer_direct_pf_lf(
                src_ptrs=[hosts[n] for n in g],
                dst_ptrs=[fresh[n][layer] for n in g],
                src_indices=src,
                dst_indices=dst,
                layer_id=layer,
                page_size=PS,
            )
    for name in shape:
        for layer in range(layers):
            for d, back in zip(DEV_PAGES, LOAD_PAGES):
                assert same(fresh[name][layer][back * PS : (back + 1) * PS], parts[name][layer][d * PS : (d + 1) * PS])
            others = torch.ones(9 * PS, dtype=torch.bool)
            others[rows(LOAD_PAGES)] = False
            assert not fresh[name][layer][others].view(torch.uint8).any()


def test_a_per_layer_load_of_several_layers_starts_at_layer_id():
    """sgl_kernel's contract: dst is those layers' K buffers then their V buffers, host layers from layer_id on."""
    k, v = host_tensor(4, (2, 8)), host_tensor(4, (2, 8))
    k.copy_(rand(*k.shape, seed=1))
    v.copy_(rand(*v.shape, seed=2))
    dk = [torch.zeros(9 * PS, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    dv = [torch.zeros(9 * PS, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    io.transfer_kv_per_layer_direct_pf_lf(
        src_ptrs=[k, v], dst_ptrs=dk + dv, src_indices=rows([6, 0]), dst_indices=rows([4, 8]), layer_id=2, page_size=PS
    )
    for j in range(2):
        for h, d in zip([6, 0], [4, 8]):
            assert same(dk[j][d * PS : (d + 1) * PS], k[h, 2 + j]) and same(dv[j][d * PS : (d + 1) * PS], v[h, 2 + j])


def test_transfer_kv_direct_copies_row_indexed_layers_in_runs():
    """The layer_first op: any mix of consecutive runs and jumps lands row for row."""
    src_layers = [rand(40, 2, 8, seed=s) for s in (3, 4)]
    dst_layers = [torch.zeros(40, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    src = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23, 0, 1, 2, 3])
    dst = torch.tensor([30, 31, 32, 33, 8, 9, 10, 11, 12, 13, 14, 15])
    io.transfer_kv_direct(src_layers=src_layers, dst_layers=dst_layers, src_indices=src, dst_indices=dst, page_size=PS)
    for s_layer, d_layer in zip(src_layers, dst_layers):
        assert same(d_layer[dst], s_layer[src])
        others = torch.ones(40, dtype=torch.bool)
        others[dst] = False
        assert not d_layer[others].view(torch.uint8).any()


def test_the_direct_ops_check_their_indices_as_sgl_kernel_does():
    host, dev = host_tensor(1, (1, 8)), [torch.zeros(9 * PS, 1, 8, dtype=torch.bfloat16)]
    with pytest.raises(RuntimeError, match="same length"):
        io.transfer_kv_all_layer_direct_lf_pf(dev, [host], rows([1]), rows([1, 2]), PS)
    with pytest.raises(RuntimeError, match="divisible by page size"):
        io.transfer_kv_per_layer_direct_pf_lf([host], dev, torch.arange(3), torch.arange(3), 0, PS)


def _kvcacheio_names(path: Path) -> set[str]:
    """Names a module imports from sgl_kernel.kvcacheio (at any depth: SGLang's are under ``if _is_cuda``)."""
    tree = ast.parse(path.read_text())
    return {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "sgl_kernel.kvcacheio"
        for a in n.names
    }


def test_it_has_every_name_sglangs_host_pools_import_and_the_kernel_ops_raise():
    sglang = pytest.importorskip("sglang")
    root = Path(sglang.__file__).parent / "srt" / "mem_cache"
    names: set[str] = set()
    for rel in ("pool_host/mha.py", "pool_host/mla.py", "memory_pool_host.py"):
        found = _kvcacheio_names(root / rel)
        assert found, rel
        names |= found
    direct = {"transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf"}
    assert direct <= names and not hasattr(io, "get_device_accessible_ptr")
    for name in sorted(names - direct):
        with pytest.raises(RuntimeError, match=rf"sgl_kernel\.kvcacheio\.{name} is not part of kvtier's stand-in"):
            getattr(io, name)(None, None)
    with pytest.raises(RuntimeError, match=r"sgl_kernel\.int8_scaled_mm is not part of kvtier's stand-in"):
        pkg.int8_scaled_mm()
    assert pkg.quantization.ggml_dequantize.__name__ == "ggml_dequantize"  # (a submodule, not a stub)
    assert pkg.STANDIN and not hasattr(pkg, "_mock_name")  # (no stub for a private name: introspection probes them)
