"""GPU tests of the packaged grouped FP8 GEMM against a local fp32 dequantised reference."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # the lead's conftest skips gpu tests too; be safe standalone
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kdump.errors import ContractViolation  # noqa: E402
from kdump.kernels import sm120  # noqa: E402

_ok, _why = sm120.is_available()
if not _ok:
    pytest.skip(f"packaged kernel unavailable: {_why}", allow_module_level=True)

FP8 = torch.float8_e4m3fn
DEV = "cuda"


# ----------------------------------------------------------------------------- reference helpers


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def quantize_rows(x: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row 1x128 quantisation of [..., R, K] -> (fp8, scales [..., R, kb] fp32, dequantised)."""
    k = x.shape[-1]
    kb = math.ceil(k / 128)
    xp = torch.nn.functional.pad(x, (0, kb * 128 - k)).unflatten(-1, (kb, 128))
    s = xp.abs().amax(-1).clamp(min=1e-4) / 448.0
    if ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xp / s.unsqueeze(-1)).clamp(-448, 448).to(FP8)
    deq = (q.float() * s.unsqueeze(-1)).flatten(-2)[..., :k]
    return q.flatten(-2)[..., :k].contiguous(), s, deq


def quantize_b_blocks(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SM90 128x128 block quantisation of [G, N, K] -> (fp8, scales [G, nb, kb], dequantised)."""
    g, n, k = b.shape
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    bp = torch.nn.functional.pad(b, (0, kb * 128 - k, 0, nb * 128 - n))
    blocks = bp.view(g, nb, 128, kb, 128)
    s = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-4) / 448.0
    q = (blocks / s[:, :, None, :, None]).clamp(-448, 448).to(FP8)
    deq = (q.float() * s[:, :, None, :, None]).view(g, nb * 128, kb * 128)[:, :n, :k]
    return q.view(g, nb * 128, kb * 128)[:, :n, :k].contiguous(), s.contiguous(), deq


def pack_ue8m0_mn_major(s: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales [..., R, kb] -> int32 [..., R, ceil(kb/4)], MN-major."""
    kb = s.shape[-1]
    kw = math.ceil(kb / 4)
    e = (torch.log2(s).round() + 127).to(torch.int32).clamp(0, 255).to(torch.uint8)
    e = torch.nn.functional.pad(e, (0, kw * 4 - kb), value=127).contiguous()
    packed = e.view(torch.int32)  # little endian: byte j of word w is k-block 4w + j
    return mn_major(packed)


def mn_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, laid out with stride(-2) = 1 and stride(-1) = align(rows, 4) per group."""
    *lead, r, c = t.shape
    ar = align(r, 4)
    strides = (1, ar)
    if lead:
        strides = (c * ar, 1, ar)
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


class Problem:
    """Random operands in both scale formats plus their dequantised values."""

    def __init__(self, a_shape: tuple[int, ...], g: int, n: int, k: int, ue8m0: bool, seed: int):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        a = torch.randn(*a_shape, k, device=DEV, generator=gen)
        b = torch.randn(g, n, k, device=DEV, generator=gen)
        self.a_fp8, sa, self.a_deq = quantize_rows(a, ue8m0)
        if ue8m0:
            self.b_fp8, sb, self.b_deq = quantize_rows(b, True)
            self.sfa, self.sfb = pack_ue8m0_mn_major(sa), pack_ue8m0_mn_major(sb)
        else:
            self.b_fp8, sb, self.b_deq = quantize_b_blocks(b)
            self.sfa, self.sfb = mn_major(sa), sb
        del a, b

    @property
    def a(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a_fp8, self.sfa

    @property
    def b(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b_fp8, self.sfb


def labels_for(counts: list[int], slot: int) -> torch.Tensor:
    """Decode-style label layout: every expert owns `slot` rows (a multiple of 128); its first
    counts[g] rows carry g, the rest -1."""
    lab = torch.full((len(counts), slot), -1, dtype=torch.int32)
    for g, c in enumerate(counts):
        lab[g, :c] = g
    return lab.flatten().to(DEV)


def labels_packed(counts: list[int], extra_tiles: int = 0) -> torch.Tensor:
    """Prefill-style layout: groups packed one after another, each padded to 128 rows."""
    parts = []
    for g, c in enumerate(counts):
        lab = torch.full((align(c, 128),), -1, dtype=torch.int32)
        lab[:c] = g
        parts.append(lab)
    parts.append(torch.full((extra_tiles * 128,), -1, dtype=torch.int32))
    return torch.cat(parts).to(DEV)


def reference_contiguous(p: Problem, labels: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(p.a_deq.shape[0], p.b_deq.shape[1], device=DEV)
    lab = labels.long()
    for g in torch.unique(lab[lab >= 0]).tolist():
        rows = (lab == g).nonzero().squeeze(1)
        out[rows] = p.a_deq[rows] @ p.b_deq[g].T
    return out


def check_contiguous(p: Problem, labels: torch.Tensor, d: torch.Tensor) -> float:
    """Valid rows match the reference; rows of skipped (-1) tiles and the padding rows after the
    last labelled row of each tile are untouched (NaN)."""
    lab = labels.cpu()
    valid = (lab >= 0).to(DEV)
    ref = reference_contiguous(p, labels)
    assert not torch.isnan(d[valid]).any(), "a valid row was not written"
    diff = calc_diff(d[valid].float(), ref[valid])
    assert diff <= 1e-3, f"calc_diff {diff}"
    if lab.numel() % 128 == 0:
        tiles = lab.view(-1, 128)
        pos = torch.arange(128).expand_as(tiles)
        first_on = tiles[:, 0] >= 0
        last = torch.where(tiles >= 0, pos, -1).amax(1)
        untouched = ~first_on[:, None] | (pos > last[:, None])
        untouched = untouched.flatten().to(DEV)
        assert torch.isnan(d[untouched]).all(), "padding rows of a tile were written"
    return diff


def poisoned(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEV)


# ----------------------------------------------------------------------------- contiguous


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
@pytest.mark.parametrize("nk", [(512, 4096), (4096, 256)], ids=["w13", "w2"])
@pytest.mark.parametrize("tokens", [1, 32, 113, 512])
def test_reference_shapes(ue8m0: bool, nk: tuple[int, int], tokens: int) -> None:
    g, (n, k) = 288, nk
    gen = torch.Generator().manual_seed(tokens)
    lo, hi = max(0, int(tokens * 0.7)), int(tokens * 1.3) + 1
    counts = torch.randint(lo, hi, (g,), generator=gen).tolist()
    counts[3] = 0  # an empty expert
    slot = align(max(max(counts), 1), 128)
    labels = labels_for(counts, slot)
    p = Problem((labels.numel(),), g, n, k, ue8m0, seed=tokens)
    d = poisoned((labels.numel(), n))
    sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, labels)
    diff = check_contiguous(p, labels, d)
    print(f"ref g={g} n={n} k={k} tokens={tokens} ue8m0={ue8m0}: calc_diff={diff:.2e}")


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
def test_odd_and_empty_groups_strided_d(ue8m0: bool) -> None:
    counts = [1, 0, 129, 255, 0, 37, 256, 3, 16, 17, 127]
    labels = labels_packed(counts, extra_tiles=1)
    n, k = 192, 320  # partial N tile, partial K block
    p = Problem((labels.numel(),), len(counts), n, k, ue8m0, seed=7)
    buf = poisoned((labels.numel(), n + 64))
    d = buf[:, :n]  # strided view: d.stride(0) = n + 64
    sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, labels)
    check_contiguous(p, labels, d)
    assert torch.isnan(buf[:, n:]).all(), "wrote outside the strided view"


@pytest.mark.parametrize("k", [128, 256, 512, 640])
def test_thin_tiles_any_k_blocks(k: int) -> None:
    """Thin tiles with 1, 2, 4 and 5 K blocks."""
    counts = [1, 16, 33, 64, 65, 0, 100, 8]
    labels = labels_for(counts, 128)
    p = Problem((labels.numel(),), len(counts), 256, k, True, seed=k)
    d = poisoned((labels.numel(), 256))
    sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, labels)
    torch.cuda.synchronize()
    check_contiguous(p, labels, d)


def test_all_empty_leaves_d_untouched() -> None:
    labels = torch.full((512,), -1, dtype=torch.int32, device=DEV)
    p = Problem((512,), 4, 256, 256, True, seed=1)
    d = poisoned((512, 256))
    sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, labels)
    torch.cuda.synchronize()
    assert torch.isnan(d).all()


def psum_rows(ends: list[int]) -> torch.Tensor:
    """Row labels implied by a psum layout (for the reference): -1 outside every group."""
    m = max(align(ends[-1], 128), 128)
    lab = torch.full((m,), -1, dtype=torch.int32)
    prev = 0
    for g, e in enumerate(ends):
        start = align(prev, 128)
        lab[start:e] = g
        prev = e
    return lab.to(DEV)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
@pytest.mark.parametrize("groups", [8, 1, 40, 700, 1200])
def test_psum_layout(ue8m0: bool, groups: int) -> None:
    """Group lookup by lane ballots over chunks of group ends (G <= 993, chunks of 1..31
    ends) and by binary search above that; empty groups anywhere, also at chunk edges."""
    if groups == 8:
        counts = [5, 0, 130, 128, 0, 0, 77, 1]
    else:
        gen = torch.Generator().manual_seed(groups)
        counts = torch.randint(0, 140, (groups,), generator=gen)
        counts[torch.rand(groups, generator=gen) < 0.3] = 0
        counts = counts.tolist()
    ends, prev = [], 0
    for c in counts:
        start = align(prev, 128)
        prev = start + c
        ends.append(prev)
    lab = psum_rows(ends)
    p = Problem((lab.numel(),), len(counts), 256, 512 if groups <= 40 else 256, ue8m0, seed=3)
    d = poisoned((lab.numel(), 256))
    layout = torch.tensor(ends, dtype=torch.int32, device=DEV)
    sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, layout, use_psum_layout=True)
    ref = reference_contiguous(p, lab)
    valid = lab >= 0
    assert not torch.isnan(d[valid]).any()
    assert calc_diff(d[valid].float(), ref[valid]) <= 1e-3
    assert torch.isnan(d[~valid]).all(), "psum padding rows must stay untouched"


def test_determinism_bitwise() -> None:
    counts = [113] * 64
    labels = labels_for(counts, 128)
    p = Problem((labels.numel(),), 64, 512, 4096, True, seed=11)
    outs = []
    for _ in range(3):
        d = poisoned((labels.numel(), 512))
        sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, labels)
        outs.append(d)
    for o in outs[1:]:
        same = (o.view(torch.int16) == outs[0].view(torch.int16)).all()
        assert bool(same), "results differ between identical runs"


@pytest.mark.parametrize("ue8m0", [True, False], ids=["ue8m0", "fp32"])
def test_scale_layouts_agree(ue8m0: bool) -> None:
    """Scales in DeepGEMM's MN-major layout, K-major, or MN-major with an odd stride: bitwise
    the same result."""
    counts = [5, 0, 130, 77, 1]
    labels = labels_for(counts, 256)
    m = labels.numel()
    p = Problem((m,), len(counts), 384, 1536, ue8m0, seed=21)
    k_major = p.sfa.contiguous()
    odd = torch.empty_strided(p.sfa.shape, (1, m + 1), dtype=p.sfa.dtype, device=DEV)
    odd.copy_(p.sfa)
    sfb_k_major = p.sfb.contiguous() if ue8m0 else p.sfb
    outs = []
    for sfa, sfb in ((p.sfa, p.sfb), (k_major, sfb_k_major), (odd, p.sfb)):
        d = poisoned((m, 384))
        sm120.m_grouped_fp8_gemm_nt_contiguous((p.a_fp8, sfa), (p.b_fp8, sfb), d, labels)
        outs.append(d)
    assert check_contiguous(p, labels, outs[0]) <= 1e-3
    for o in outs[1:]:
        assert bool((o.view(torch.int16) == outs[0].view(torch.int16)).all())


def test_argument_errors() -> None:
    p = Problem((256,), 2, 128, 256, False, seed=2)
    labels = labels_packed([100, 100])
    d = poisoned((256, 128))
    with pytest.raises(ContractViolation, match="float8_e4m3fn"):
        sm120.m_grouped_fp8_gemm_nt_contiguous((p.a_fp8.float(), p.sfa), p.b, d, labels)
    with pytest.raises(ContractViolation, match="shape"):
        sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d[:128], labels)
    with pytest.raises(ContractViolation, match="both be float32"):
        sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, (p.b_fp8, p.sfb.int()), d, labels)
    with pytest.raises(ContractViolation, match="int32"):
        sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, labels.long())


# ----------------------------------------------------------------------------- masked


def reference_masked(p: Problem, masked_m: list[int]) -> torch.Tensor:
    return torch.einsum("gmk,gnk->gmn", p.a_deq, p.b_deq)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
@pytest.mark.parametrize("case", ["small", "decode"])
def test_masked(ue8m0: bool, case: str) -> None:
    if case == "small":
        g, max_m, n, k = 6, 384, 256, 512
        masked = [0, 1, 128, 200, 384, 77]
    else:
        g, max_m, n, k = 288, 128, 512, 4096
        masked = torch.randint(0, 114, (g,), generator=torch.Generator().manual_seed(5)).tolist()
    p = Problem((g, max_m), g, n, k, ue8m0, seed=13)
    d = poisoned((g, max_m, n))
    mm = torch.tensor(masked, dtype=torch.int32, device=DEV)
    sm120.m_grouped_fp8_gemm_nt_masked(p.a, p.b, d, mm, expected_m=max(masked))
    ref = reference_masked(p, masked)
    rows = torch.arange(max_m, device=DEV)[None, :] < mm[:, None]
    assert not torch.isnan(d[rows]).any()
    diff = calc_diff(d[rows].float(), ref[rows])
    assert diff <= 1e-3, diff
    assert torch.isnan(d[~rows]).all(), "rows beyond masked_m were written"
    print(f"masked {case} ue8m0={ue8m0}: calc_diff={diff:.2e}")


# ----------------------------------------------------------------------------- CUDA graphs


def _capture(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up on a side stream (builds and loads the module outside the capture)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def test_graph_replay_after_label_mutation() -> None:
    g, n, k = 32, 512, 1024
    slot = 256
    counts0 = [113] * g
    labels = labels_for(counts0, slot)
    p = Problem((labels.numel(),), g, n, k, True, seed=17)
    d = poisoned((labels.numel(), n))
    graph = _capture(lambda: sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, labels))
    gen = torch.Generator().manual_seed(0)
    phases = {
        "identical": counts0,
        "permuted": torch.randint(0, slot + 1, (g,), generator=gen).tolist(),
        "all_empty": [0] * g,
        "one_hot": [0] * (g - 1) + [slot],
    }
    for name, counts in phases.items():
        labels.copy_(labels_for(counts, slot))
        d.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if name == "all_empty":
            assert torch.isnan(d).all(), name
        else:
            check_contiguous(p, labels, d)


def test_graph_replay_after_masked_mutation() -> None:
    g, max_m, n, k = 16, 256, 256, 512
    p = Problem((g, max_m), g, n, k, False, seed=19)
    d = poisoned((g, max_m, n))
    mm = torch.full((g,), 100, dtype=torch.int32, device=DEV)
    graph = _capture(lambda: sm120.m_grouped_fp8_gemm_nt_masked(p.a, p.b, d, mm, 100))
    ref = reference_masked(p, [])
    for masked in ([100] * g, list(range(0, 256, 16)), [0] * g, [256] * g):
        mm.copy_(torch.tensor(masked, dtype=torch.int32))
        d.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rows = torch.arange(max_m, device=DEV)[None, :] < mm[:, None]
        assert not torch.isnan(d[rows]).any()
        if rows.any():
            assert calc_diff(d[rows].float(), ref[rows]) <= 1e-3
        assert torch.isnan(d[~rows]).all()


# ----------------------------------------------------------------------------- fault injection


def test_fault_variant_clean_then_writes_past_d() -> None:
    g, n, k, slot = 16, 256, 512, 128
    faulty = sm120.make_faulty_contiguous()
    counts0 = [50] * 8 + [0] * 8  # 8 active tiles of 16
    labels = labels_for(counts0, slot)
    m = labels.numel()
    p = Problem((m,), g, n, k, True, seed=23)
    guard_rows = 4 * 128
    buf = poisoned((m + guard_rows, n))
    d = buf[:m]
    guard = buf[m:]

    # Eager with fresh buffers: clean.
    faulty(p.a, p.b, d, labels)
    torch.cuda.synchronize()
    check_contiguous(p, labels, d)
    assert torch.isnan(guard).all()

    # Capture + identical replay: clean.
    graph = _capture(lambda: faulty(p.a, p.b, d, labels))
    d.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_contiguous(p, labels, d)
    assert torch.isnan(guard).all()
    ws = faulty.workspace(d, labels)
    assert ws is not None and int(ws[0]) == 8

    # More active tiles after an in-place change: the stale schedule writes past d's end.
    labels.copy_(labels_for([50] * 11 + [0] * 5, slot))
    d.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    written = ~torch.isnan(guard).all(dim=1)
    assert int(written.sum()) == 3 * 128, f"expected 3 tiles past the end, got {written.sum()} rows"

    # The correct kernel under the same graph protocol stays inside d.
    buf.fill_(float("nan"))
    graph_ok = _capture(lambda: sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, labels))
    labels.copy_(labels_for([50] * 16, slot))
    d.fill_(float("nan"))
    graph_ok.replay()
    torch.cuda.synchronize()
    check_contiguous(p, labels, d)
    assert torch.isnan(guard).all()


# ----------------------------------------------------------------------------- compute-sanitizer

_SANITIZER_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from kdump.kernels import sm120
    faulty = sys.argv[1] == "faulty"
    g, n, k, m = 16, 256, 256, 16 * 128
    fn = sm120.make_faulty_contiguous() if faulty else sm120.m_grouped_fp8_gemm_nt_contiguous
    def labels(active):
        lab = torch.full((g, 128), -1, dtype=torch.int32)
        lab[:active, :50] = torch.arange(active, dtype=torch.int32)[:, None]
        return lab.flatten().cuda()
    a = (torch.randn(m, k, device="cuda")).clamp(-448, 448).to(torch.float8_e4m3fn)
    b = (torch.randn(g, n, k, device="cuda")).clamp(-448, 448).to(torch.float8_e4m3fn)
    sfa = torch.ones(2, m, device="cuda").t()  # MN-major [m, 2]
    sfb = torch.ones(g, 2, 2, device="cuda")
    d = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    lab = labels(8)
    fn((a, sfa), (b, sfb), d, lab)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn((a, sfa), (b, sfb), d, lab)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn((a, sfa), (b, sfb), d, lab)
    graph.replay()
    lab.copy_(labels(11))
    graph.replay()
    torch.cuda.synchronize()
    print("replays done")
    """
)


def _sanitizer() -> str | None:
    return shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer"
        if os.path.exists("/usr/local/cuda/bin/compute-sanitizer")
        else None
    )


@pytest.mark.parametrize("variant", ["correct", "faulty"])
def test_memcheck_sees_the_fault_variant_only(variant: str, tmp_path) -> None:
    exe = _sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer not found")
    log = tmp_path / "memcheck.log"
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    cmd = [
        exe,
        "--tool",
        "memcheck",
        "--report-api-errors",
        "no",
        "--print-limit",
        "4",
        "--error-exitcode",
        "9",
        "--log-file",
        str(log),
        sys.executable,
        "-c",
        _SANITIZER_SCRIPT,
        variant,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    report = log.read_text() if log.exists() else ""
    if "replays done" not in proc.stdout and proc.returncode not in (0, 9):
        pytest.skip(f"sanitizer could not run here (rc {proc.returncode}): {proc.stderr[-300:]}")
    summary = [line for line in report.splitlines() if "ERROR SUMMARY" in line]
    print(f"memcheck {variant}: rc={proc.returncode} {summary}")
    if variant == "correct":
        assert proc.returncode == 0, report[-2000:]
    else:
        assert proc.returncode == 9, report[-2000:]
        assert "Invalid __global__ write" in report, report[-2000:]
        assert "kd_gemm_labels_fp32_stale" in report
