"""Fuzzing of the transfer-argument validators with a fixed budget, on CPU device pools (the Rust copy
engine): random geometries (layers, heads, K and V head dims, equal or not, page sizes, dtypes including
uint8, bf16 and float8), random index tensors (wrong dtype or rank, non-tensors, non-contiguous views,
negative, out of range, int64 extremes, duplicates, length mismatches, pages not aligned or not consecutive,
empty), random layer ids (bools, negatives, too large, non-ints) and backends, for
``load_to_device_per_layer`` and ``backup_from_device_all_layer``.

Property: a call either raises :class:`kvtier.InvalidArgumentError` naming an offending argument, with host
and device memory byte-identical to before (both are poisoned with random bytes and compared, guard bytes
around every device layer tensor included), or copies exactly the addressed bytes and nothing else (compared
against a torch reference model of the copy on uint8 views). Which of the two must happen is decided by an
independent model of the validation rules, so a call that should have been refused and was not (or the
reverse) fails too. Index tensors are sometimes reused after an in-place change, which must be validated
again.

Budget: ``KVTIER_FUZZ_EXAMPLES`` examples (default 200). The examples run and their outcomes are printed at
the end of the module (also under ``-q``).
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier
from kvtier import host_pool_for

EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

DTYPES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
BACKEND_LAYOUTS = {"direct": ("layer_first", "page_first_direct"), "kernel": ("layer_first", "page_first")}
GUARD = 64  # poisoned bytes before and after every device layer tensor

COUNTS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    line = "test_fuzz_transfer: " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items()))
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if tr is not None and capman is not None:
        with capman.global_and_fixture_disabled():
            tr.write_line("")
            tr.write_line(line)
    else:  # pragma: no cover
        print(line)


# ------------------------------------------------------------------------------------------- pools


class GuardedDevicePool:
    """A device pool (the attributes host pools read) whose per-layer K and V tensors are contiguous views
    into one flat byte tensor, with ``GUARD`` bytes before and after each, so a write outside any layer
    tensor shows up as a changed guard byte."""

    def __init__(self, size, page_size, layers, heads, dk, dv, dtype):
        self.size, self.page_size, self.layer_num, self.head_num = size, page_size, layers, heads
        self.head_dim, self.v_head_dim, self.dtype, self.store_dtype = dk, dv, dtype, dtype
        self.device = torch.device("cpu")
        it = torch.empty((), dtype=dtype).element_size()
        rows = size + page_size
        self.rows = rows
        sizes = [rows * heads * dk * it] * layers + [rows * heads * dv * it] * layers
        total = GUARD + sum(n + GUARD for n in sizes)
        self.raw = torch.zeros(total, dtype=torch.uint8)
        tensors, off = [], GUARD
        for n, dim in zip(sizes, [dk] * layers + [dv] * layers):
            tensors.append(self.raw[off : off + n].view(dtype).view(rows, heads, dim))
            off += n + GUARD
        self.k_buffer, self.v_buffer = tensors[:layers], tensors[layers:]


def host_raws(hp):
    """Every byte of the host pool's buffers (the K and V blocks and whatever follows them)."""
    return [b.as_tensor() for b in hp._buffers]


def u8(t):
    """A uint8 view with the last dimension in bytes (exact for every dtype, float8 included)."""
    return t.view(torch.uint8)


def host_side_view(hp, raw_clone, side):
    """The host K or V tensor of ``hp`` laid over a clone of its raw buffer(s), as uint8 rows."""
    it = torch.empty((), dtype=hp.dtype).element_size()
    t = hp.k_buffer if side == "k" else hp.v_buffer
    shape = tuple(t.shape[:-1]) + (t.shape[-1] * it,)
    if isinstance(hp, kvtier.MHAHostPool):
        base = raw_clone[0]
        off = 0 if side == "k" else t.numel() * it
    else:
        base = raw_clone[0 if side == "k" else 1]
        off = 0
    n = int(np.prod(shape))
    return base[off : off + n].view(shape)


def layer_rows(hp, view, layer):
    """``(rows_view, index_fn)``: ``rows_view[index_fn(slots)]`` are the host rows of ``slots`` in ``layer``."""
    if hp.layout == "layer_first":
        return view[layer], lambda s: s
    if hp.layout == "page_first":
        return view[:, layer], lambda s: s
    ps = hp.page_size
    return view[:, layer], lambda s: (s // ps, s % ps)


# ------------------------------------------------------------------------------------------- the rules


def index_problem(t, name):
    """Why ``t`` is not a 1-D int64 tensor, or None; the values as a list otherwise."""
    if not isinstance(t, torch.Tensor):
        return name, None
    if t.dtype != torch.int64 or t.dim() != 1:
        return name, None
    return None, t.tolist()


def expected_errors(hp, rows, h, d, layer, backend, op):
    """The set of argument names a correct validator may complain about (empty: the call must succeed)."""
    errs = set()
    if op == "load" and (isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < hp.layer_num):
        errs.add("layer_id")
    if backend not in BACKEND_LAYOUTS or hp.layout not in BACKEND_LAYOUTS[backend]:
        errs.add("backend")
    bad_h, hv = index_problem(h, "host_indices")
    bad_d, dv = index_problem(d, "device_indices")
    errs |= {x for x in (bad_h, bad_d) if x}
    if hv is None or dv is None:
        return errs
    ps, paged = hp.page_size, hp.layout == "page_first_direct"
    if len(hv) != len(dv):
        errs |= {"host_indices", "device_indices"}
    if any(not 0 <= v < hp.size for v in hv):
        errs.add("host_indices")
    if any(not 0 <= v < rows for v in dv):
        errs.add("device_indices")
    if paged or (backend == "direct" and hp.layout == "layer_first"):
        if len(hv) % ps:
            errs.add("host_indices")
    if paged:
        for g in range(0, len(hv) - len(hv) % ps, ps):
            grp = hv[g : g + ps]
            if grp[0] % ps or grp != list(range(grp[0], grp[0] + ps)):
                errs.add("host_indices")
        if len(dv) % ps:
            errs.add("device_indices")
        for g in range(0, len(dv) - len(dv) % ps, ps):
            grp = dv[g : g + ps]
            if grp != list(range(grp[0], grp[0] + ps)):
                errs.add("device_indices")
    dest = hv if op == "backup" else dv
    if len(set(dest)) != len(dest):
        errs.add("host_indices" if op == "backup" else "device_indices")
    return errs


MESSAGE_NAMES = {
    "host_indices": ("host_indices",),
    "device_indices": ("device_indices",),
    "layer_id": ("layer_id",),
    "backend": ("io_backend", "IO backend"),
}


# ------------------------------------------------------------------------------------------- strategies


@st.composite
def geometries(draw):
    asym = draw(st.booleans())
    layout = draw(st.sampled_from(["page_first", "page_first_direct"] if asym else
                                  ["layer_first", "page_first", "page_first_direct"]))
    ps = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    heads = draw(st.integers(1, 4))
    dk = draw(st.integers(1, 48))
    dv = draw(st.integers(1, 47).map(lambda x: x + (x >= dk))) if asym else dk  # != dk
    layers = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(DTYPES))
    dev_pages = draw(st.integers(1, 5))
    return layout, ps, heads, dk, dv, layers, dtype, dev_pages


INT64_EXTREMES = [-(2**63), 2**63 - 1, -(2**31), 2**31, 2**32 + 1]


@st.composite
def index_values(draw, limit, ps, mode, n):
    """``n`` distinct whole pages or ``n`` distinct in-range tokens (or nothing) out of ``limit`` slots, then
    a few mutations (values set anywhere near the range, dropped, added, duplicated, shifted, int64
    extremes)."""
    if mode == "empty":
        vals = []
    elif mode == "pages":
        pages = draw(st.permutations(range(limit // ps)))[:n]
        vals = [p * ps + i for p in pages for i in range(ps)]
    else:
        vals = draw(st.lists(st.integers(0, limit - 1), min_size=n, max_size=n, unique=True))
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 0, 0, 1, 1, 2]))):
        what = draw(st.sampled_from(["set", "set", "drop", "append", "dup", "shift", "extreme"]))
        if what == "set" and vals:
            vals[draw(st.integers(0, len(vals) - 1))] = draw(st.integers(-3, limit + 3))
        elif what == "drop" and vals:
            del vals[draw(st.integers(0, len(vals) - 1))]
        elif what == "append":
            vals.append(draw(st.integers(-1, limit)))
        elif what == "dup" and vals:
            vals.append(vals[draw(st.integers(0, len(vals) - 1))])
        elif what == "shift" and vals:
            k = draw(st.integers(-2, 2))
            vals = [min(max(v + k, -(2**63)), 2**63 - 1) for v in vals]  # shifted extremes stay int64
        elif what == "extreme":
            pos = draw(st.integers(0, len(vals)))
            vals.insert(pos, draw(st.sampled_from(INT64_EXTREMES)))
    return vals


@st.composite
def index_object(draw, vals):
    """``vals`` as a 1-D int64 tensor (maybe a non-contiguous view), or as something invalid."""
    form = draw(st.sampled_from(["tensor"] * 45 + ["strided", "int32", "uint8", "float", "bool", "2d", "0d", "list", "numpy"]))
    fits32 = all(-(2**31) <= v < 2**31 for v in vals)
    if form == "strided":
        big = torch.full((2 * len(vals) + 1,), -7, dtype=torch.int64)
        big[1::2] = torch.tensor(vals, dtype=torch.int64)
        return big[1::2]
    if form == "int32" and fits32:
        return torch.tensor(vals, dtype=torch.int32)
    if form == "uint8":
        return torch.tensor([v % 256 for v in vals], dtype=torch.uint8)
    if form == "float":
        return torch.tensor(vals, dtype=torch.float64)
    if form == "bool":
        return torch.tensor([bool(v) for v in vals], dtype=torch.bool)
    if form == "2d":
        return torch.tensor(vals, dtype=torch.int64).reshape(1, -1)
    if form == "0d" and vals:
        return torch.tensor(vals[0], dtype=torch.int64)
    if form == "list":
        return list(vals)
    if form == "numpy":
        return np.array(vals, dtype=np.int64)
    return torch.tensor(vals, dtype=torch.int64)


@st.composite
def cases(draw):
    layout, ps, heads, dk, dv, layers, dtype, dev_pages = draw(geometries())
    size = dev_pages * ps
    rows = size + ps
    host_size = (2 * size // ps + 1) * ps  # HiCache sizing at ratio 2 (checked in the test)
    op = draw(st.sampled_from(["load", "backup"]))
    good_backends = [b for b, ls in BACKEND_LAYOUTS.items() if layout in ls]
    backend = draw(st.sampled_from(good_backends * 16 + ["kernel", "direct", "dma", ""]))
    if op == "load":
        if draw(st.integers(0, 5)):
            layer = draw(st.integers(0, layers - 1))
        else:
            layer = draw(st.sampled_from([-1, layers, layers + 1, True, False, 0.0, np.int64(0), None]))
    else:
        layer = None
    paged = layout == "page_first_direct" or (layout == "layer_first" and backend == "direct")
    mode = draw(st.sampled_from(["pages"] * 8 + ["tokens"] * (1 if paged else 6) + ["empty"]))
    n = draw(st.integers(1, dev_pages + 1) if mode == "pages" else st.integers(1, min(rows, 3 * ps + 2)))
    hv = draw(index_values(host_size, ps, mode, n))
    # the device list: the same count (and kind) most of the time
    dmode = mode if draw(st.integers(0, 5)) else draw(st.sampled_from(["pages", "tokens", "empty"]))
    dn = n if dmode == mode and draw(st.integers(0, 5)) else draw(
        st.integers(1, dev_pages + 1) if dmode == "pages" else st.integers(1, min(rows, 3 * ps + 2)))
    dvals = draw(index_values(rows, ps, dmode, dn))
    h = draw(index_object(hv))
    d = draw(index_object(dvals))
    # reuse: a valid call first with other (valid) tensors' values, then an in-place change to these values
    reuse = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(layout=layout, ps=ps, heads=heads, dk=dk, dv=dv, layers=layers, dtype=dtype, size=size,
                rows=rows, host_size=host_size, op=op, backend=backend, layer=layer, h=h, d=d, reuse=reuse,
                seed=seed)


# ------------------------------------------------------------------------------------------- the property


def poison(t, gen):
    t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))


def call(hp, dp, op, h, d, layer, backend):
    if op == "load":
        hp.load_to_device_per_layer(dp, h, d, layer, backend)
    else:
        hp.backup_from_device_all_layer(dp, h, d, backend)


def reference(hp, dp, host_before, dev_before, op, hv, dvals, layer):
    """Expected (host raw bytes, device raw bytes) after a valid call."""
    host = [b.clone() for b in host_before]
    dev = dev_before.clone()
    h = torch.tensor(hv, dtype=torch.int64)
    d = torch.tensor(dvals, dtype=torch.int64)
    if len(hv) == 0:
        return host, dev
    it = torch.empty((), dtype=dp.dtype).element_size()
    layers = [layer] if op == "load" else range(hp.layer_num)
    offs, off = [], GUARD
    for dim in [dp.head_dim] * dp.layer_num + [dp.v_head_dim] * dp.layer_num:
        offs.append((off, dim))
        off += dp.rows * dp.head_num * dim * it + GUARD
    for s, side in enumerate(("k", "v")):
        hview = host_side_view(hp, host, side)
        for layer_ in layers:
            o, dim = offs[s * dp.layer_num + layer_]
            drows = dev[o : o + dp.rows * dp.head_num * dim * it].view(dp.rows, dp.head_num, dim * it)
            rows_view, index = layer_rows(hp, hview, layer_)
            if op == "load":
                drows[d] = rows_view[index(h)]
            else:
                rows_view[index(h)] = drows[d]
    return host, dev


@FUZZ
@given(cases())
def test_transfer_arguments_raise_or_copy_exactly(c):
    COUNTS["examples"] += 1
    dp = GuardedDevicePool(c["size"], c["ps"], c["layers"], c["heads"], c["dk"], c["dv"], c["dtype"])
    hp = host_pool_for(dp, layout=c["layout"], pin_memory=False)
    assert (hp.size, hp.layer_num, hp.page_size) == (c["host_size"], c["layers"], c["ps"])
    gen = torch.Generator().manual_seed(c["seed"])
    op, backend, layer, h, d = c["op"], c["backend"], c["layer"], c["h"], c["d"]

    if c["reuse"] and isinstance(h, torch.Tensor) and isinstance(d, torch.Tensor) and h.dtype == d.dtype == torch.int64 \
            and h.dim() == d.dim() == 1 and h.numel() == d.numel() and h.numel() > 0 \
            and backend in BACKEND_LAYOUTS and hp.layout in BACKEND_LAYOUTS[backend]:
        # A valid call with these very tensor objects (first/only page, distinct slots), then an in-place
        # write of the fuzzed values: the validation cache must notice and check them again.
        want_h, want_d = h.tolist(), d.tolist()
        n = h.numel()
        ps = hp.page_size
        ok_h = [i % hp.size for i in range(n)]
        ok_d = [i % dp.rows for i in range(n)]
        if len(set(ok_h)) == n and len(set(ok_d)) == n and (hp.layout != "page_first_direct" or n % ps == 0) \
                and (hp.layout != "layer_first" or backend != "direct" or n % ps == 0):
            h.copy_(torch.tensor(ok_h))
            d.copy_(torch.tensor(ok_d))
            first_layer = 0 if op == "load" else None
            assert not expected_errors(hp, dp.rows, h, d, first_layer, backend, op)
            call(hp, dp, op, h, d, first_layer, backend)
            COUNTS["reused_tensors"] += 1
            h.copy_(torch.tensor(want_h))
            d.copy_(torch.tensor(want_d))

    raws = host_raws(hp)
    for r in raws:
        poison(r, gen)
    poison(dp.raw, gen)
    host_before = [r.clone() for r in raws]
    dev_before = dp.raw.clone()
    errs = expected_errors(hp, dp.rows, h, d, layer, backend, op)

    try:
        call(hp, dp, op, h, d, layer, backend)
    except kvtier.InvalidArgumentError as e:
        msg = str(e)
        assert errs, f"refused a valid call: {msg}"
        assert any(n in msg for x in errs for n in MESSAGE_NAMES[x]), f"message names none of {errs}: {msg}"
        assert all(torch.equal(a, b) for a, b in zip(raws, host_before)), "host memory changed by a refused call"
        assert torch.equal(dp.raw, dev_before), "device memory changed by a refused call"
        COUNTS["raised"] += 1
        for x in errs:
            COUNTS[f"raised_{x}"] += 1
        return
    assert not errs, f"accepted a call that should be refused for {errs}"
    hv, dvals = h.tolist(), d.tolist()
    want_host, want_dev = reference(hp, dp, host_before, dev_before, op, hv, dvals, layer)
    for a, b in zip(raws, want_host):
        if not torch.equal(a, b):
            bad = (a != b).nonzero().flatten()[:8].tolist()
            raise AssertionError(f"host bytes differ from the reference at byte offsets {bad}")
    if not torch.equal(dp.raw, want_dev):
        bad = (dp.raw != want_dev).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"device bytes differ from the reference at byte offsets {bad} (guards included)")
    COUNTS["copied_empty" if not hv else "copied"] += 1
