"""The torch reference against an independent float64 computation, and calc_diff."""

from __future__ import annotations

import math

import pytest
import torch

from kdump.kernels.deepgemm import reference as ref_
from kdump.kernels.deepgemm.specs import (
    MGroupedBF16NTContiguous,
    MGroupedBF16NTMasked,
    MGroupedFP8NNContiguous,
    MGroupedFP8NTContiguous,
    MGroupedFP8NTMasked,
)
from kdump.replay.metrics import calc_diff

SMALL = {"num_groups": 5, "n": 192, "k": 384, "expected_m": 40}


# --- an independent float64 model of the kernel ---------------------------------------------


def _unpack_naive(words: torch.Tensor, kb: int) -> torch.Tensor:
    """Packed int32 [.., mn, kw] -> float64 [.., mn, kb]: byte j of word w is block 4w+j."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    cols = []
    for blk in range(kb):
        byte = (w[..., blk // 4] >> (8 * (blk % 4))) & 0xFF
        cols.append(torch.pow(2.0, byte.to(torch.float64) - 127))
    return torch.stack(cols, dim=-1)


def _dequant64(data: torch.Tensor, scale: torch.Tensor | None, gran_mn: int) -> torch.Tensor:
    """data [.., MN, K] -> float64 with scales expanded element by element."""
    x = data.to(torch.float64)
    if scale is None:
        return x
    k = x.shape[-1]
    kb = math.ceil(k / 128)
    s = _unpack_naive(scale, kb) if scale.dtype == torch.int32 else scale.to(torch.float64)
    mn = x.shape[-2]
    rows = torch.arange(mn) // gran_mn
    cols = torch.arange(k) // 128
    return x * s[..., rows, :][..., :, cols]


def _naive(spec, bound) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected float64 D, bool row mask), row by row from the routing's definition."""
    fp8 = spec.fp8
    a, sfa = bound["a"] if fp8 else (bound["a"], None)
    b, sfb = bound["b"] if fp8 else (bound["b"], None)
    if spec.nn:
        b = b.transpose(1, 2)
        sfb = sfb.transpose(-1, -2) if sfb is not None else None
    gran_b = 128 if (sfb is not None and sfb.dtype == torch.float32) else 1
    a64 = _dequant64(a, sfa, 1)
    b64 = _dequant64(b, sfb, gran_b)
    d = bound["d"]
    out = torch.zeros(d.shape, dtype=torch.float64)
    if spec.masked:
        valid = torch.zeros(d.shape[:2], dtype=torch.bool)
        for g, cnt in enumerate(bound["masked_m"].tolist()):
            for r in range(cnt):
                out[g, r] = b64[g] @ a64[g, r]
                valid[g, r] = True
        return out, valid.unsqueeze(-1)
    layout = bound["grouped_layout"].tolist()
    m = d.shape[0]
    owner = [-1] * m
    if bound.get("use_psum_layout"):
        prev = 0
        for g, end in enumerate(layout):
            start = 0 if g == 0 else -(-prev // 128) * 128
            for r in range(start, end):
                owner[r] = g
            prev = end
    else:
        owner = layout
    valid = torch.tensor([o >= 0 for o in owner])
    for r, g in enumerate(owner):
        if g >= 0:
            out[r] = b64[g] @ a64[r]
    return out, valid.unsqueeze(-1)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(x.abs().clamp(min=1e-30)))
    return torch.pow(2.0, e - 7)


CASES = [
    (MGroupedFP8NTContiguous, {"scale_format": "ue8m0", "empty_groups": 1}),
    (MGroupedFP8NTContiguous, {"scale_format": "fp32"}),
    (MGroupedFP8NTContiguous, {"scale_format": "ue8m0", "use_psum_layout": True}),
    (MGroupedFP8NTContiguous, {"scale_format": "fp32", "use_psum_layout": True, "empty_groups": 2}),
    (MGroupedFP8NNContiguous, {"scale_format": "fp32"}),
    (MGroupedFP8NNContiguous, {"scale_format": "ue8m0"}),
    (MGroupedFP8NTMasked, {"scale_format": "ue8m0", "empty_groups": 1}),
    (MGroupedFP8NTMasked, {"scale_format": "fp32"}),
    (MGroupedBF16NTContiguous, {}),
    (MGroupedBF16NTMasked, {}),
]


@pytest.mark.parametrize(("cls", "kw"), CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_reference_matches_float64_model(cls, kw):
    spec = cls()
    args, kwargs = spec.generate(seed=7, **SMALL, **kw)
    bound = spec.bind(args, kwargs)
    got = spec.reference(bound)["d"]
    want, valid = _naive(spec, bound)
    assert got.dtype == torch.bfloat16 and got.shape == bound["d"].shape
    mask = torch.broadcast_to(valid, got.shape)
    assert int(mask.sum()) > 0
    # The meaningful mask is exactly the rows the model computes.
    assert torch.equal(torch.broadcast_to(spec.meaningful(bound, "d"), got.shape), mask)
    # bf16 output rounding alone costs calc_diff ~1e-6 against exact math; against the exact
    # value rounded to bf16 the reference is far closer.
    assert calc_diff(got.to(torch.float64), want, mask) < 5e-6
    assert calc_diff(got.to(torch.float64), want.to(torch.bfloat16).double(), mask) < 1e-6
    # Rounding: one round-to-nearest of an fp32 sum -> within half a bf16 ulp of the exact value
    # plus fp32 accumulation error; nearly every element is the correctly rounded value.
    g64, w = got.to(torch.float64)[mask], want[mask]
    scale = w.abs().max().item()
    assert torch.all((g64 - w).abs() <= 0.5 * _bf16_ulp(w) + 1e-5 * scale)
    exact = (g64 == w.to(torch.bfloat16).to(torch.float64)).double().mean().item()
    assert exact > 0.98
    # Rows outside every group are zero in the reference.
    assert torch.all(got[~mask] == 0)


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_float32_sums_match_float64(fmt):
    """Before the bf16 rounding the reference is the dequantised product to fp32 accuracy."""
    spec = MGroupedFP8NTContiguous()
    args, kwargs = spec.generate(seed=4, **SMALL, scale_format=fmt)
    bound = spec.bind(args, kwargs)
    (a, sfa), (b, sfb) = bound["a"], bound["b"]
    gran_b = 128 if fmt == "fp32" else 1
    groups = ref_.label_groups(bound["grouped_layout"], SMALL["num_groups"])
    got = ref_.grouped_gemm(
        ref_.Operand(a, sfa, 1, 128),
        ref_.Operand(b, sfb, gran_b, 128),
        bound["d"],
        groups,
        out_dtype=torch.float32,
    )
    want, valid = _naive(spec, bound)
    assert got.dtype == torch.float32
    assert calc_diff(got.double(), want, valid) < 1e-10


def test_reference_skips_invalid_labels_and_all_empty():
    spec = MGroupedFP8NTContiguous()
    args, kwargs = spec.generate(seed=3, **SMALL)
    bound = spec.bind(args, kwargs)
    layout = bound["grouped_layout"].clone()
    layout[:5] = 99  # out of range: a violation, skipped if forced through the reference
    forced = dict(bound, grouped_layout=layout)
    assert spec.validate(forced)
    got = spec.reference(forced)["d"]
    assert torch.all(got[:5] == 0)
    full = spec.reference(bound)["d"]
    assert torch.equal(got[5:], full[5:])
    empty = dict(bound, grouped_layout=torch.full_like(layout, -1))
    assert torch.all(spec.reference(empty)["d"] == 0)


def test_reference_depends_on_routing_and_scales():
    spec = MGroupedFP8NTContiguous()
    args, kwargs = spec.generate(seed=5, **SMALL, scale_format="fp32")
    bound = spec.bind(args, kwargs)
    base = spec.reference(bound)["d"]
    a, sfa = bound["a"]
    sfa2 = sfa.clone()
    sfa2[0, 0] *= 2
    doubled = spec.reference(dict(bound, a=(a, sfa2)))["d"]
    assert not torch.equal(doubled[0], base[0]) and torch.equal(doubled[1:], base[1:])


def test_calc_diff():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    assert calc_diff(x, -x) == pytest.approx(2.0)
    assert calc_diff(x, 2 * x) == pytest.approx(1 - 4 / 5)
    z = torch.zeros(4)
    assert calc_diff(z, z) == 0.0
    y = x.clone()
    y[0, 0] = float("nan")
    assert math.isnan(calc_diff(x, y))
    mask = torch.ones(64, 1, dtype=torch.bool)
    mask[0] = False
    assert calc_diff(x, y, mask) == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(ValueError):
        calc_diff(x, x[:1])


@pytest.mark.gpu
def test_reference_on_gpu_matches_cpu():
    spec = MGroupedFP8NTContiguous()
    args, kwargs = spec.generate(seed=9, device="cuda", **SMALL, scale_format="ue8m0")
    bound = spec.bind(args, kwargs)
    got = spec.reference(bound)["d"]
    assert got.device.type == "cuda"
    cpu_args, cpu_kwargs = spec.generate(seed=9, device="cpu", **SMALL, scale_format="ue8m0")
    want = spec.reference(spec.bind(cpu_args, cpu_kwargs))["d"]
    mask = spec.meaningful(bound, "d").cpu()
    assert calc_diff(got.cpu().double(), want.double(), mask) < 1e-6
