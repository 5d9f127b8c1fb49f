"""The fused snapshot kernel launched directly, bitwise against the reference semantics
(`gather.reference_gather`) for every path it has: bulk asynchronous copies (sm_90+) and 16-, 4-
and 1-byte units of contiguous rows,
strided rows of 8-, 4-, 2- and 1-byte elements and of an odd element size, every row rule, row
counts that leave a partial block, and plain copies of odd sizes and alignments."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest
import torch

from kdump.bundle.tensors import group_storages
from kdump.record.flight import gather

pytestmark = pytest.mark.gpu
_SLOT = struct.Struct("<IIQQQIIQQQ")  # SlotHead
_RECORD = struct.Struct("<IIQQQIIQQQ")


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _launch(plan: gather.Plan | None, tensors, rule, copies=(), fn=None, split=None, blocks=None):
    """Run the kernel (the shipped build, or `fn`) once on fresh control words, with `split`
    units per window and `blocks` gather blocks when given (else gather_grid's with the device's
    resident blocks); returns (records sorted, call record)."""
    fn = fn or gather.get_kernel(torch.cuda.current_device()).snapshot
    storages = group_storages(tensors)[0] if tensors else []
    p = gather.SnapParams()
    ring = torch.zeros(plan.worst if plan else 256, dtype=torch.uint8, device="cuda")
    ctrl = torch.zeros(2, dtype=torch.int64, device="cuda")
    record = torch.zeros(8, dtype=torch.int64, device="cuda")
    for k, (src, dst) in enumerate(copies):
        c = p.copies[k]
        c.src, c.dst, c.nbytes = src.data_ptr(), dst.data_ptr(), src.numel() * src.element_size()
    p.n_copies = len(copies)
    resident = gather.get_kernel(torch.cuda.current_device()).resident
    span_ptr = lambda i: int(storages[i].base_ptr) + int(storages[i].span_start)  # noqa: E731
    gather.set_plan(p, plan, span_ptr, resident)
    if plan is not None and split is not None:
        p.split, p.gather_blocks = split, -(-plan.rows // gather.ROWS_PER_BLOCK) * split
    if plan is not None and blocks is not None:
        p.gather_blocks = blocks
    if plan is not None:
        p.rule = rule.data_ptr() if rule is not None else 0
        p.rule_n = rule.numel() if rule is not None else 0
        p.ring, p.ring_bytes = ring.data_ptr(), ring.numel()
    p.ctrl, p.record, p.seq, p.call_index = ctrl.data_ptr(), record.data_ptr(), 7, 11
    stream = torch.cuda.current_stream().cuda_stream
    gather.launch(fn, p, stream)
    torch.cuda.synchronize()
    rec = _RECORD.unpack(record.cpu().numpy().tobytes())
    magic, rows, seq, token, pos, done, counter, complete, call_index, head_after = rec
    # an eager call's token is its seq
    assert (magic, seq, token, complete, call_index) == (gather.RECORD_MAGIC, 7, 7, 7, 11)
    assert done == 0 and counter == 0, "the launch's scratch words are reset for the next one"
    if plan is None:
        return None, rec
    assert pos == 0
    # what the launch may overwrite was marked for the salvage, also when no row was touched
    assert int(ctrl[1]) == plan.worst
    head = _SLOT.unpack(ring[: gather.SLOT_HEAD].cpu().numpy().tobytes())
    assert head[0] == gather.SLOT_MAGIC and head[5] == rows and head[-1] == token
    assert int(ctrl[0]) == head_after == head[7]
    got = ring[gather.SLOT_HEAD : gather.SLOT_HEAD + rows * plan.rec_bytes].cpu()
    return gather.sort_records(got.reshape(rows, plan.rec_bytes)), rec


def _check(
    tensors,
    gathered,
    rule_name,
    rule,
    row_dims,
    alignment=1,
    tweak=None,
    fn=None,
    split=None,
    blocks=None,
):
    storages, records = group_storages(tensors)
    rule_i = None if rule is None else next(i for i, t in enumerate(tensors) if t is rule)
    plan = gather.make_plan(
        tensors, records, storages, gathered, rule_name, rule_i, row_dims, alignment
    )
    assert plan is not None
    if tweak is not None:
        plan = replace(plan, gathers=tuple(replace(g, **tweak) for g in plan.gathers))
    got, _ = _launch(plan, tensors, rule, fn=fn, split=split, blocks=blocks)
    spans = []
    for i, s in enumerate(storages):
        t = tensors[next(ti for ti, r in enumerate(records) if r.storage == i)]
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        spans.append(whole[s.span_start : s.span_start + s.span_nbytes].cpu())
    _, want = gather.reference_gather(plan, spans, rule.cpu() if rule is not None else None)
    assert got.shape == want.shape
    assert torch.equal(got, want)
    return plan


def _labels(sizes, block=128):
    out = []
    for e, n in enumerate(sizes):
        out += [e] * n + [-1] * (block - n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def _bytes(shape, seed, dtype=torch.uint8):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
    return t.view(dtype) if dtype.itemsize == 1 else t


def test_labels_rule_with_fp8_rows_and_mn_major_scales(side_by_side):
    labels = _labels([1, 0, 128, 17, 113, 64, 3])
    m = labels.numel()
    a = _bytes((m, 512), 1, torch.float8_e4m3fn)
    sfa = torch.empty_strided((m, 4), (1, m), dtype=torch.float32, device="cuda")
    sfa.copy_(torch.randn(m, 4, device="cuda"))
    plan = _check([a, sfa, labels], [0, 1], "labels", labels, 1, fn=side_by_side)
    assert plan.gathers[0].cols == 1 and plan.gathers[1].cols == 4  # contiguous, strided


def test_masked_rule_on_three_dimensional_operands_with_packed_scales(side_by_side):
    g_, max_m, k = 5, 96, 384
    a = _bytes((g_, max_m, k), 2)
    sf = torch.empty_strided(
        (g_, max_m, 3), (max_m * 3, 1, max_m), dtype=torch.int32, device="cuda"
    )
    sf.copy_(torch.randint(-(2**31), 2**31 - 1, (g_, max_m, 3), dtype=torch.int32))
    masked = torch.tensor([0, 96, 1, 50, 95], dtype=torch.int32, device="cuda")
    _check([a, sf, masked], [0, 1], "masked", masked, 2, fn=side_by_side)


def test_psum_rule_with_aligned_group_starts():
    ends = torch.tensor([5, 130, 130, 300, 517], dtype=torch.int32, device="cuda")
    a = _bytes((640, 256), 3)
    _check([a, ends], [0], "psum", ends, 1, alignment=128)


@pytest.mark.parametrize("rule_name", ["labels", "masked", "psum"])
def test_every_rule_with_no_touched_row_publishes_an_empty_slot(rule_name):
    # a replay after a routing change that sent no token to this rank's experts
    if rule_name == "labels":
        rule, a, dims = _labels([0, 0, 0]), _bytes((384, 256), 4), 1
    elif rule_name == "masked":
        rule, a, dims = torch.zeros(3, dtype=torch.int32, device="cuda"), _bytes((3, 64, 256), 4), 2
    else:
        rule, a, dims = torch.zeros(3, dtype=torch.int32, device="cuda"), _bytes((384, 256), 4), 1
    _check([a, rule], [0], rule_name, rule, dims, alignment=128 if rule_name == "psum" else 1)


def test_odd_units_elements_and_a_partial_last_block():
    rows = 300  # 256 + 44: the second block is partial
    bf = _bytes((rows, 200), 4).view(torch.bfloat16)  # 200-byte rows: 4-byte units
    odd = _bytes((rows, 37), 5)  # 37-byte rows: bytewise
    wide = torch.empty_strided((rows, 3), (1, rows), dtype=torch.int64, device="cuda")
    wide.copy_(torch.randint(-(2**62), 2**62, (rows, 3), dtype=torch.int64))
    _check([bf, odd, wide], [0, 1, 2], "all", None, 1)
    half = torch.empty_strided((rows, 5), (1, rows + 3), dtype=torch.float16, device="cuda")
    half.copy_(torch.randn(rows, 5, device="cuda"))
    small = _bytes((rows, 6), 6)[:, ::2]  # 1-byte elements two bytes apart
    _check([half, small], [0, 1], "all", None, 1)


@pytest.mark.parametrize("cols", [1, 32, 700, 1366])
def test_strided_four_byte_rows_staged_in_passes(cols):
    # MN-major 4-byte rows go through shared memory in passes of (4096 // cols - 2) rows: one
    # pass for scales of K = 4096 (32 columns), many at 700 columns; past 1365 columns the
    # direct path takes them
    rows = 300
    sf = torch.empty_strided((rows, cols), (1, rows + 1), dtype=torch.float32, device="cuda")
    sf.copy_(torch.randn(rows, cols, device="cuda"))
    labels = _labels([0, 61, 3], block=100)
    plan = _check([sf, labels], [0], "labels", labels, 1)
    assert plan.gathers[0].cols == cols


def _mn_major(rows, cols, seed, pad=0, dtype=torch.float32):
    """[rows, cols] 4-byte elements, MN-major with the column stride rounded up to 4 rows (as
    DeepGEMM's TMA-aligned scales), plus `pad` more."""
    ld = -(-rows // 4) * 4 + pad
    t = torch.empty_strided((rows, cols), (1, ld), dtype=dtype, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    t.view(torch.int32).copy_(
        torch.randint(
            -(2**31), 2**31 - 1, (rows, cols), dtype=torch.int32, device="cuda", generator=g
        )
    )
    return t


@pytest.fixture(params=["built for this GPU", "plain path"])
def whole_windows(request):
    """The kernel as built for this GPU (None: sm_90+ reads whole windows of scales before the
    rule) and its plain path (what a GPU before sm_90 runs: only the touched rows, after it)."""
    return None if request.param == "built for this GPU" else _plain_build()


@pytest.mark.parametrize(
    ("sizes", "cols", "blocks"),
    [
        ([1, 0, 128, 17, 113, 64, 3], 32, None),  # decode-like routing, one window a block
        ([1, 0, 128, 17, 113, 64, 3], 32, 1),  # one block: every window in turn, empty ones too
        ([5, 0, 0, 128, 2], 62, 2),  # the widest window the buffer holds
        ([5, 0, 0, 128, 2], 63, None),  # one column more: the staged gather takes it
        ([127, 1], 4, None),
    ],
)
def test_scales_alone_read_as_whole_windows(sizes, cols, blocks, whole_windows):
    # A call whose only gathered tensor is MN-major 4-byte scales (16-byte aligned columns):
    # each window's columns are bulk-copied whole into shared memory before the rule is read,
    # and only the touched rows' records are written
    labels = _labels(sizes)
    sf = _mn_major(labels.numel(), cols, 21)
    _check([sf, labels], [0], "labels", labels, 1, blocks=blocks, fn=whole_windows)


@pytest.mark.parametrize("rows", [302, 259, 384])
def test_whole_windows_with_a_partial_last_window(rows, whole_windows):
    # the last window's rows past a multiple of 4 are read from global memory when stored
    # (259: its 3 rows are all read so, its bulk copies move nothing)
    sf = _mn_major(rows, 8, 22)
    _check([sf], [0], "all", None, 1, fn=whole_windows)
    labels = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    labels[rows - 3 :] = 1
    labels[:5] = 0
    _check([sf, labels], [0], "labels", labels, 1, fn=whole_windows)


@pytest.mark.parametrize(("max_m", "pad"), [(256, 0), (128, 4), (96, 0)])
def test_whole_windows_under_the_masked_and_psum_rules(max_m, pad, whole_windows):
    # masked: a window is one group's rows when max_m is a multiple of the window (else the
    # staged gather); psum: groups start at aligned rows of one [M, cols] tensor
    g_ = 3
    sf = torch.empty_strided(
        (g_, max_m, 5), (5 * (max_m + pad), 1, max_m + pad), dtype=torch.float32, device="cuda"
    )
    sf.copy_(torch.randn(g_, max_m, 5, device="cuda"))
    masked = torch.tensor([max_m, 1, max_m - 7], dtype=torch.int32, device="cuda")
    _check([sf, masked], [0], "masked", masked, 2, fn=whole_windows)
    ends = torch.tensor([3, 129, 129, 300], dtype=torch.int32, device="cuda")
    flat = _mn_major(384, 6, 23)
    _check([flat, ends], [0], "psum", ends, 1, alignment=128, fn=whole_windows)


@pytest.fixture(params=["built for this GPU", "plain path"])
def side_by_side(request):
    """The kernel as built for this GPU (None: sm_90+ gathers a call's rows and its strided
    scales side by side) and its plain path (what a GPU before sm_90 runs: one after the
    other, without bulk copies)."""
    return None if request.param == "built for this GPU" else _plain_build()


@pytest.mark.parametrize(
    ("rule_name", "split", "blocks", "cols", "scales_first"),
    [
        ("labels", None, None, 32, False),  # decode-like routing, the recorder's split
        ("labels", 3, None, 32, True),  # the scales are the call's first gather
        ("labels", 9, 1, 8, False),  # one block: every unit in turn
        ("labels", 1, 2, 600, False),  # one row per pass through the scales' smaller share
        ("labels", 1, None, 683, False),  # too wide for that share: one gather after the other
        ("psum", None, None, 32, True),
    ],
)
def test_rows_and_their_scales_side_by_side(
    rule_name, split, blocks, cols, scales_first, side_by_side
):
    # A's rows (several bulk pieces each, a last piece of 16 B) and its MN-major scales: the
    # bulk copies' issuers take the rows while the other warps stage the scales
    labels = _labels([1, 0, 128, 17, 113, 64, 3])
    m = labels.numel()
    rule = labels
    if rule_name == "psum":
        rule = torch.tensor([1, 1, 256, 273, 497, 704, 771], dtype=torch.int32, device="cuda")
    a = _bytes((m, 4096 + 16), 31)
    sf = _mn_major(m, cols, 32)
    tensors = [sf, a, rule] if scales_first else [a, sf, rule]
    plan = _check(
        tensors,
        [0, 1],
        rule_name,
        rule,
        1,
        alignment=128 if rule_name == "psum" else 1,
        split=split,
        blocks=blocks,
        fn=side_by_side,
    )
    assert [g.cols for g in plan.gathers] == ([cols, 1] if scales_first else [1, cols])


def test_bulk_copied_rows_of_several_gathers_in_one_launch():
    # 16-byte aligned contiguous rows take the bulk asynchronous copies on sm_90+: rows shorter
    # than a stage (48 B), spanning several stages (4096 + 16 B: a last piece of 16 B), and two
    # such gathers in one launch (each starts its barriers at phase 0 again), under a rule that
    # leaves uneven counts per block; then every row (full blocks, many pieces per issuer)
    labels = _labels([0, 1, 128, 77, 5, 128, 2], block=128)
    m = labels.numel()
    short, long_ = _bytes((m, 48), 12), _bytes((m, 4112), 13)
    _check([short, long_, labels], [0, 1], "labels", labels, 1)
    _check([long_, short], [0, 1], "all", None, 1)


@pytest.mark.parametrize(("split", "blocks"), [(1, None), (3, None), (8, 5), (128, None), (9, 1)])
def test_windows_split_into_units(split, blocks, side_by_side):
    # a window's `split` units share its touched rows evenly, each reserving its own records:
    # units with no rows (fewer touched rows than units), uneven shares, one row per unit;
    # `blocks` gather blocks take the units round robin (one block: every unit, in rounds of
    # KD_UNITS); the rows are bulk-copied (16-byte aligned) and the scales staged
    labels = _labels([0, 1, 5, 128, 77, 127], block=128)
    m = labels.numel()
    a = _bytes((m, 1024), 15)
    sf = torch.empty_strided((m, 8), (1, m), dtype=torch.float32, device="cuda")
    sf.copy_(torch.randn(m, 8, device="cuda"))
    _check(
        [a, sf, labels], [0, 1], "labels", labels, 1, split=split, blocks=blocks, fn=side_by_side
    )


_plain: list[object] = []


def _plain_build():
    """kd_snapshot as a GPU before sm_90 runs it (no bulk copies, no whole windows, one gather
    after the other): compiled to sm_80 PTX, which the driver compiles for this GPU at load;
    loaded once."""
    if _plain:
        return _plain[0]
    from cuda.core import Program, ProgramOptions

    from kdump.cuda.nvrtc import check, driver

    # the kernel's loader makes torch's context current on this thread (a worker whose first
    # test builds the plain path has none yet)
    gather.get_kernel(torch.cuda.current_device())
    opts = ProgramOptions(arch="sm_80", std="c++17", define_macro=gather.define_flags())
    ptx = bytes(Program(gather.kernel_source(), "c++", opts).compile("ptx").code)
    assert b"cp.async.bulk" not in ptx and b".target sm_80" in ptx
    module = check(driver().cuModuleLoadData(ptx.rstrip(b"\0") + b"\0"), "cuModuleLoadData")
    fn = check(driver().cuModuleGetFunction(module, b"kd_snapshot"), "get kd_snapshot")
    gather.allow_smem(fn, gather.SMEM_BYTES)
    _plain.append(fn)
    return fn


def test_plain_build_gathers_the_same_rows():
    labels = _labels([0, 1, 128, 77, 5], block=128)
    m = labels.numel()
    a = _bytes((m, 4096), 14)
    sf = torch.empty_strided((m, 32), (1, m), dtype=torch.float32, device="cuda")
    sf.copy_(torch.randn(m, 32, device="cuda"))
    _check([a, sf, labels], [0, 1], "labels", labels, 1, fn=_plain_build())


def test_strided_rows_of_an_element_size_without_a_unit():
    # Every supported dtype has a 1/2/4/8-byte element; the kernel still copies any other size
    # (bytewise): 3-byte elements six bytes apart, a plan made by hand over a uint8 tensor.
    base = _bytes((270, 24), 9)
    t = base[:, ::6]  # `base` in the call too: the storage's span covers every 3-byte element
    plan = _check([t, base], [0], "all", None, 1, tweak={"elem": 3})
    assert plan.gathers[0].elem == 3 and plan.gathers[0].cols == 4


def test_plain_copies_of_odd_sizes_and_alignments():
    src = _bytes((3 << 20,), 8)
    dst = torch.zeros_like(src)
    pieces = [  # (offset, length): 16-aligned, 4-aligned, unaligned, tiny, empty
        (0, 1 << 20),
        (1 << 20, 100_004),
        ((1 << 20) + 100_004 + 3, 77_777),
        (2 << 20, 5),
        ((2 << 20) + 64, 0),
    ]
    copies = [(src[o : o + n], dst[o : o + n]) for o, n in pieces]
    _launch(None, [], None, copies)
    for o, n in pieces:
        assert torch.equal(dst[o : o + n], src[o : o + n])
    untouched = torch.ones_like(src, dtype=torch.bool)
    for o, n in pieces:
        untouched[o : o + n] = False
    assert not dst[untouched].any(), "nothing outside the ranges is written"


def test_mark_kernel_copies_a_token_to_mapped_host_memory():
    mark = gather.get_kernel(torch.cuda.current_device()).mark
    src = torch.tensor([0x1234_5678_9ABC_DEF0 - 2**64 // 2], dtype=torch.int64, device="cuda")
    host = torch.zeros(2, dtype=torch.int64, pin_memory=True)
    stream = torch.cuda.current_stream().cuda_stream
    gather.launch_mark(mark, src.data_ptr(), host.data_ptr() + 8, stream)
    torch.cuda.synchronize()
    assert host.tolist() == [0, src.item()]
