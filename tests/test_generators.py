"""Scale packing, the synthetic-call generators, and routing mutations."""

from __future__ import annotations

import pytest
import torch

from kdump.kernels.deepgemm import generators as gen_
from kdump.kernels.deepgemm.scales import (
    align,
    empty_mn_major,
    is_mn_major_tma_aligned,
    pack_ue8m0,
    round_up_to_ue8m0,
    tma_aligned_size,
    unpack_ue8m0,
)
from kdump.kernels.deepgemm.specs import (
    MGroupedBF16NTMasked,
    MGroupedFP8NNContiguous,
    MGroupedFP8NTContiguous,
    MGroupedFP8NTMasked,
)

SMALL = {"num_groups": 6, "n": 256, "k": 512, "expected_m": 50}


# --- scale helpers -------------------------------------------------------------------------------


def test_align_and_tma_size():
    assert align(0, 128) == 0 and align(1, 128) == 128 and align(128, 128) == 128
    assert tma_aligned_size(5, 4) == 8 and tma_aligned_size(8, 4) == 8
    assert tma_aligned_size(5, 1) == 16


@pytest.mark.parametrize(("mn", "kb"), [(1, 1), (7, 3), (33, 8), (130, 9)])
def test_ue8m0_round_trip(mn, kb):
    g = torch.Generator().manual_seed(mn * 100 + kb)
    exps = torch.randint(-127, 128, (3, mn, kb), generator=g)
    sf = torch.pow(2.0, exps.to(torch.float64)).to(torch.float32)
    packed = pack_ue8m0(sf)
    assert packed.dtype == torch.int32
    assert packed.shape == (3, mn, (kb + 3) // 4)
    assert is_mn_major_tma_aligned(packed)
    assert packed.stride(-2) == 1 and packed.stride(-1) == align(mn, 4)
    back = unpack_ue8m0(packed, kb)
    assert torch.equal(back, sf)  # bit-exact, 2^-127 included


def test_unpack_any_strides():
    sf = torch.pow(2.0, torch.arange(-6, 6, dtype=torch.float32)).reshape(12, 1)
    packed = pack_ue8m0(sf)  # [12, 1], strides (1, 12)
    assert packed.stride() == (1, 12)
    for sel in (slice(3, 4), slice(0, 12), slice(5, 5)):
        assert torch.equal(unpack_ue8m0(packed[sel], 1), sf[sel])
    odd = torch.as_strided(packed, (1, 1), (1, 36864))
    assert unpack_ue8m0(odd, 1).item() == 2.0**-6


def test_ue8m0_byte_order():
    # byte j of word w is the exponent of K block 4w + j (little-endian), value 2^(byte - 127)
    word = 127 | (128 << 8) | (126 << 16) | (130 << 24)
    word -= 1 << 32  # as a signed int32
    packed = torch.tensor([[word, 127]], dtype=torch.int32)
    vals = unpack_ue8m0(packed, 5)
    assert vals.tolist() == [[1.0, 2.0, 0.5, 8.0, 1.0]]
    assert torch.equal(pack_ue8m0(vals).contiguous(), packed)


def test_pack_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        pack_ue8m0(torch.tensor([[1.0, 3.0]]))
    with pytest.raises(ValueError, match="power of two"):
        pack_ue8m0(torch.tensor([[-2.0]]))
    with pytest.raises(ValueError, match="float32"):
        pack_ue8m0(torch.tensor([[1.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="at most"):
        unpack_ue8m0(torch.zeros(2, 1, dtype=torch.int32), 5)


def test_round_up_and_mn_major_layout():
    x = torch.tensor([0.3, 1.0, 1.5, 2.0**-20 * 1.1])
    assert round_up_to_ue8m0(x).tolist() == [0.5, 1.0, 2.0, 2.0**-19]
    t = empty_mn_major((2,), 5, 3, torch.float32, "cpu")
    assert t.shape == (2, 5, 3) and t.stride() == (24, 1, 8)
    assert is_mn_major_tma_aligned(t) and not is_mn_major_tma_aligned(t.contiguous())


def test_to_fp8_saturates_instead_of_nan():
    x = torch.tensor([1e6, -1e6, 447.0, 0.5])
    q = gen_.to_fp8(x)
    assert not torch.isnan(q.float()).any()
    assert q.float().tolist() == [448.0, -448.0, 448.0, 0.5]


# --- generators ----------------------------------------------------------------------------------


def test_group_sizes_follow_deepgemm_distribution():
    g = torch.Generator().manual_seed(0)
    sizes = gen_.draw_group_sizes(g, 200, 100)
    assert all(70 <= s <= 130 for s in sizes)
    assert len(set(sizes)) > 20
    sizes = gen_.draw_group_sizes(g, 50, 100, empty_groups=7)
    assert sizes.count(0) == 7


def test_label_and_psum_layouts():
    labels = gen_.label_layout([3, 0, 130], 128)
    assert labels.numel() == 128 + 256
    assert labels[:3].tolist() == [0, 0, 0] and torch.all(labels[3:128] == -1)
    assert torch.all(labels[128:258] == 2) and torch.all(labels[258:] == -1)
    ends = gen_.psum_layout([3, 0, 130, 5], 128)
    assert ends.tolist() == [3, 128, 258, 389]
    assert gen_.psum_rows(ends.tolist(), 128) == 512
    with pytest.raises(ValueError):
        gen_.label_layout([200], 128, m=128)


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_contiguous_call_layout(fmt):
    spec = MGroupedFP8NTContiguous()
    args, kwargs = spec.generate(seed=2, **SMALL, scale_format=fmt, empty_groups=1, d_pad_cols=64)
    (a, sfa), (b, sfb), d, layout = args
    m = layout.numel()
    assert a.shape == (m, 512) and a.dtype == torch.float8_e4m3fn and a.is_contiguous()
    assert b.shape == (6, 256, 512) and b.dtype == torch.float8_e4m3fn
    assert d.shape == (m, 256) and d.stride() == (256 + 64, 1) and d.dtype == torch.bfloat16
    assert layout.dtype == torch.int32 and m % 128 == 0
    counts = torch.bincount(layout[layout >= 0].long(), minlength=6)
    assert (counts == 0).sum() == 1
    if fmt == "ue8m0":
        assert sfa.dtype == torch.int32 and sfa.shape == (m, 1) and sfa.stride() == (1, m)
        assert sfb.shape == (6, 256, 1) and is_mn_major_tma_aligned(sfb)
    else:
        assert sfa.dtype == torch.float32 and sfa.shape == (m, 4) and sfa.stride() == (1, m)
        assert sfb.shape == (6, 2, 4) and sfb.is_contiguous()
    assert spec.validate(spec.bind(args, kwargs)) == []
    for t in (a, b):
        assert not torch.isnan(t.float()).any()
        assert t.float().abs().sum() > 0
    # padding rows of A are zero, valid rows are not
    assert torch.all(a[layout < 0].float() == 0)
    assert torch.all(a[layout >= 0].float().abs().sum(dim=1) > 0)


def test_generation_is_deterministic():
    spec = MGroupedFP8NTMasked()
    a1, _ = spec.generate(seed=4, **SMALL)
    a2, _ = spec.generate(seed=4, **SMALL)
    a3, _ = spec.generate(seed=5, **SMALL)
    assert torch.equal(a1[0][0].view(torch.uint8), a2[0][0].view(torch.uint8))
    assert torch.equal(a1[3], a2[3]) and torch.equal(a1[1][1], a2[1][1])
    assert not torch.equal(a1[0][0].view(torch.uint8), a3[0][0].view(torch.uint8))


def test_masked_and_nn_and_bf16_calls():
    masked = MGroupedFP8NTMasked()
    args, kwargs = masked.generate(seed=1, **SMALL, max_m=96, scale_format="fp32")
    (a, sfa), _, d, masked_m, expected_m = args
    assert a.shape == (6, 96, 512) and d.shape == (6, 96, 256)
    assert sfa.shape == (6, 96, 4) and sfa.stride(-2) == 1
    assert expected_m == 50 and masked_m.max() <= 96
    assert masked.validate(masked.bind(args, kwargs)) == []

    nn = MGroupedFP8NNContiguous()
    args, kwargs = nn.generate(seed=1, **SMALL, scale_format="ue8m0")
    b, sfb = args[1]
    assert b.shape == (6, 512, 256) and b.is_contiguous()  # [G, K, N], N-major
    assert sfb.shape == (6, 1, 256)  # packed words x N, transposed view of the NT layout
    assert nn.validate(nn.bind(args, kwargs)) == []

    bf16 = MGroupedBF16NTMasked()
    args, kwargs = bf16.generate(seed=1, **SMALL)
    assert args[0].dtype == torch.bfloat16 and not isinstance(args[0], tuple)
    assert bf16.validate(bf16.bind(args, kwargs)) == []


def test_generate_rejects_unknown_keywords():
    with pytest.raises(TypeError, match="unknown shape keywords"):
        MGroupedFP8NTContiguous().generate(seed=0, bogus=1)
    with pytest.raises(TypeError):
        MGroupedFP8NTMasked().generate(seed=0, use_psum_layout=True)


# --- mutations -----------------------------------------------------------------------------------

MUTATION_CASES = [
    (MGroupedFP8NTContiguous, {}),
    (MGroupedFP8NTContiguous, {"use_psum_layout": True}),
    (MGroupedFP8NTMasked, {}),
]


@pytest.mark.parametrize(("cls", "kw"), MUTATION_CASES)
def test_mutations_keep_shape_and_are_valid(cls, kw):
    spec = cls()
    args, kwargs = spec.generate(seed=8, **SMALL, **kw)
    bound = spec.bind(args, kwargs)
    key = "masked_m" if spec.masked else "grouped_layout"
    orig = bound[key]
    before = orig.clone()
    muts = list(spec.mutations(bound, seed=1, count=3))
    names = [m.name for m in muts]
    for want in ("permuted", "all_empty", "one_hot", "max_skew", "align_minus_one"):
        assert want in names
    assert sum(n.startswith("random_") for n in names) == 3
    assert torch.equal(orig, before)  # the original is not touched
    seen = set()
    for m in muts:
        assert set(m.values) == {key}
        new = m.values[key]
        assert new.shape == orig.shape and new.dtype == orig.dtype and new.device == orig.device
        assert spec.validate({**bound, **m.values}) == [], m.name
        seen.add(tuple(new.tolist()))
        rows = int(spec.meaningful({**bound, **m.values}, "d").sum())
        if m.name == "all_empty":
            assert rows == 0
        if m.name == "one_hot":  # one group holds all the rows it can
            assert rows == (bound["d"].shape[1] if spec.masked else bound["d"].shape[0])
    assert len(seen) >= 5  # the scenarios really differ
    perm = next(m for m in muts if m.name == "permuted").values[key]
    assert not torch.equal(perm, orig)


def test_one_hot_contiguous_holds_every_row():
    spec = MGroupedFP8NTContiguous()
    args, kwargs = spec.generate(seed=8, **SMALL)
    bound = spec.bind(args, kwargs)
    hot = next(m for m in spec.mutations(bound) if m.name == "one_hot")
    labels = hot.values["grouped_layout"]
    assert torch.all(labels == labels[0]) and int(labels[0]) >= 0
