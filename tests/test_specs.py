"""Spec signatures, registry resolution, contract validation and tolerances."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kdump import envinfo
from kdump.errors import ContractViolation, UsageError
from kdump.kernels.deepgemm.scales import pack_ue8m0
from kdump.kernels.deepgemm.specs import (
    MGroupedBF16NTContiguous,
    MGroupedFP8NNContiguous,
    MGroupedFP8NTContiguous,
    MGroupedFP8NTMasked,
)
from kdump.kernels.deepgemm.state import state as library_state
from kdump.kernels.generic import GenericSpec
from kdump.kernels.plugin import Role
from kdump.kernels.registry import all_specs, spec_for

SMALL = {"num_groups": 4, "n": 256, "k": 512, "expected_m": 60}


def _call(spec, seed=0, **kw):
    args, kwargs = spec.generate(seed=seed, **{**SMALL, **kw})
    return spec.bind(args, kwargs)


def _messages(violations) -> str:
    return " | ".join(str(v) for v in violations)


# --- signatures and registry ---------------------------------------------------------------------


def test_params_mirror_deepgemm_signatures():
    spec = MGroupedFP8NTContiguous()
    assert spec.param_names() == [
        "a",
        "b",
        "d",
        "grouped_layout",
        "recipe",
        "recipe_a",
        "recipe_b",
        "compiled_dims",
        "disable_ue8m0_cast",
        "use_psum_layout",
        "ensure_zero_padding",
        "expected_m_for_psum_layout",
        "epilogue",
    ]
    assert spec.names_with_role(Role.ROUTING) == ["grouped_layout"]
    assert spec.names_with_role(Role.OUTPUT) == ["d"]
    masked = MGroupedFP8NTMasked()
    assert masked.param_names()[:5] == ["a", "b", "d", "masked_m", "expected_m"]
    assert masked.names_with_role(Role.HINT) == ["expected_m", "compiled_dims"]
    assert spec.library() == "deep_gemm" and spec.has_reference()


def test_bind_accepts_old_m_indices_name():
    spec = MGroupedFP8NTContiguous()
    args, _ = spec.generate(seed=0, **SMALL)
    bound = spec.bind(args[:3], {"m_indices": args[3], "disable_ue8m0_cast": True})
    assert bound["grouped_layout"] is args[3] and bound["disable_ue8m0_cast"] is True
    assert bound["compiled_dims"] == "nk" and bound["use_psum_layout"] is False
    with pytest.raises(UsageError, match="unexpected argument"):
        spec.bind(args, {"bogus": 1})
    with pytest.raises(UsageError, match="twice"):
        spec.bind(args, {"m_indices": args[3]})


@pytest.mark.parametrize(
    ("target", "want"),
    [
        ("deep_gemm:m_grouped_fp8_gemm_nt_contiguous", MGroupedFP8NTContiguous),
        ("deep_gemm:m_grouped_fp8_fp4_gemm_nt_contiguous", MGroupedFP8NTContiguous),
        ("vllm.third_party.deep_gemm:m_grouped_fp8_gemm_nt_contiguous", MGroupedFP8NTContiguous),
        ("torch.ops.deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous", MGroupedFP8NTContiguous),
        ("deep_gemm:fp8_m_grouped_gemm_nt_masked", MGroupedFP8NTMasked),
        ("m_grouped_fp8_fp4_gemm_nt_masked", MGroupedFP8NTMasked),
        ("deep_gemm:m_grouped_fp8_fp4_gemm_nn_contiguous", MGroupedFP8NNContiguous),
        ("deep_gemm:m_grouped_bf16_gemm_nt_contiguous", MGroupedBF16NTContiguous),
    ],
)
def test_spec_for_resolves_aliases(target, want):
    assert type(spec_for(target)) is want


def test_spec_for_unknown_is_generic_and_settings_apply():
    spec = spec_for("mylib.ops:fancy_gemm", names=["x", "y"])
    assert isinstance(spec, GenericSpec) and spec.id == "mylib.ops:fancy_gemm"
    assert spec.bind([1, 2, 3], {}) == {"x": 1, "y": 2, "args[2]": 3}
    ids = [s.id for s in all_specs()]
    assert len(ids) == len(set(ids)) == 15  # m-grouped 6, k-grouped 4, mega-MoE 5
    spec64 = spec_for("deep_gemm:m_grouped_fp8_gemm_nt_contiguous", settings={"mk_alignment": 64})
    assert spec64.mk_alignment == 64
    assert spec_for("deep_gemm:m_grouped_fp8_gemm_nt_contiguous").mk_alignment == 128


def test_library_state_reads_getters_of_a_loaded_module(monkeypatch):
    fake = types.ModuleType("deep_gemm")
    fake.get_num_sms = lambda: 132
    fake.get_mk_alignment_for_contiguous_layout = lambda: 128

    def broken():
        raise RuntimeError("no CUDA")

    fake.get_tc_util = broken
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    from kdump.kernels.deepgemm import state as deepgemm_state

    deepgemm_state.reset()
    state = library_state()
    assert state["num_sms"] == 132 and state["mk_alignment"] == 128
    assert "no CUDA" in state["tc_util"]["error"] and "pdl" not in state
    assert envinfo.library_state()["deep_gemm"]["num_sms"] == 132
    monkeypatch.delitem(sys.modules, "deep_gemm")
    monkeypatch.delitem(sys.modules, "vllm.third_party.deep_gemm", raising=False)
    assert library_state() is None


# --- validation: good calls ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
@pytest.mark.parametrize("psum", [False, True])
def test_valid_contiguous_calls(fmt, psum):
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec, scale_format=fmt, use_psum_layout=psum, empty_groups=1, d_pad_cols=32)
    assert spec.validate(bound) == []
    bound = _call(spec, scale_format=fmt, use_psum_layout=psum, explicit_recipe=True)
    assert spec.validate(bound) == []


def test_fp32_per_token_scales_may_have_any_layout():
    # DeepGEMM copies per-token float32 scales into its layout itself.
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec, scale_format="fp32")
    a, sfa = bound["a"]
    assert spec.validate(dict(bound, a=(a, sfa.contiguous()))) == []


def test_validate_reads_but_does_not_change_anything():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec)
    layout = bound["grouped_layout"].clone()
    spec.validate(bound)
    assert torch.equal(layout, bound["grouped_layout"])


# --- validation: violations ----------------------------------------------------------------------


def test_label_out_of_range():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec)
    layout = bound["grouped_layout"].clone()
    layout[5] = 4
    layout[7] = 9
    v = spec.validate(dict(bound, grouped_layout=layout))
    assert len(v) == 1 and v[0].argument == "grouped_layout"
    assert "row 5 has label 4, outside [-1, 4)" in v[0].message and "2 rows" in v[0].message
    layout[5:8] = -2
    assert "label -2" in _messages(spec.validate(dict(bound, grouped_layout=layout)))


def test_misaligned_group_start():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec, group_sizes=[100, 50, 0, 20])
    layout = bound["grouped_layout"].clone()
    layout[127] = 1  # group 1 now starts at row 127, inside group 0's tile
    msg = _messages(spec.validate(dict(bound, grouped_layout=layout)))
    assert "group 1 has row 127 in the 128-row tile starting at row 0" in msg
    assert "belongs to group 0" in msg and "multiple of the mk alignment 128" in msg
    layout = bound["grouped_layout"].clone()
    layout[128] = -1  # group 1's tile now starts with padding
    msg = _messages(spec.validate(dict(bound, grouped_layout=layout)))
    assert "first row is padding" in msg


def test_mk_alignment_setting_changes_the_contract():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec, alignment=64, group_sizes=[10, 64, 0, 30])
    assert spec.validate(bound, settings={"mk_alignment": 64}) == []
    assert "mk alignment 128" in _messages(spec.validate(bound))
    assert spec.with_settings({"mk_alignment": 64}).validate(bound) == []


def test_psum_offsets():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec, use_psum_layout=True, group_sizes=[30, 0, 90, 10])
    ends = bound["grouped_layout"]
    assert ends.tolist() == [30, 128, 218, 266]
    bad = torch.tensor([30, 30, 218, 266], dtype=torch.int32)  # empty group not at aligned start
    msg = _messages(spec.validate(dict(bound, grouped_layout=bad)))
    assert "group 1 is 30, before the group's aligned start 128" in msg
    bad = torch.tensor([30, 128, 218, 999], dtype=torch.int32)
    assert "exceeds M = 384" in _messages(spec.validate(dict(bound, grouped_layout=bad)))
    wrong_len = torch.zeros(384, dtype=torch.int32)
    assert "expected [G] = [4]" in _messages(spec.validate(dict(bound, grouped_layout=wrong_len)))


def test_masked_m_out_of_range():
    spec = MGroupedFP8NTMasked()
    bound = _call(spec, max_m=64, expected_m=40)
    mm = bound["masked_m"].clone()
    mm[2] = 65
    msg = _messages(spec.validate(dict(bound, masked_m=mm)))
    assert "masked_m[2] = 65 is outside [0, max_m = 64]" in msg
    mm[2] = -1
    assert "masked_m[2] = -1" in _messages(spec.validate(dict(bound, masked_m=mm)))
    assert "positive int" in _messages(spec.validate(dict(bound, expected_m=0)))


def test_scale_stride_and_shape_violations():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec, scale_format="ue8m0", k=1024)  # two packed words per row
    (a, sfa), (b, sfb) = bound["a"], bound["b"]
    assert sfa.shape[-1] == 2 and spec.validate(bound) == []
    v = spec.validate(dict(bound, a=(a, sfa.contiguous())))  # same values, K-major
    assert len(v) == 1 and v[0].argument == "a[1]"
    assert "not TMA-aligned MN-major" in v[0].message
    assert "stride(MN) = 2, expected 1" in v[0].message
    v = spec.validate(dict(bound, b=(b, sfb.contiguous())))
    assert v[0].argument == "b[1]" and "not TMA-aligned MN-major" in v[0].message
    # an MN-major tensor whose K stride is not padded to a multiple of 4 rows
    n_odd = sfb.new_zeros(4, 2, 257).transpose(1, 2)[:, :256]
    assert "expected align(MN, 4) = 256" in _messages(spec.validate(dict(bound, b=(b, n_odd))))
    # shape: scales made for another K
    g = torch.Generator().manual_seed(0)
    sf = torch.pow(2.0, torch.randint(-3, 3, (4, 256, 4), generator=g).float())
    v = spec.validate(dict(bound, b=(b, pack_ue8m0(sf))))
    assert "packed UE8M0 scales of shape [4, 256, 1], expected [4, 256, 2]" in _messages(v)


def test_fp32_scale_violations_and_recipe_consistency():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec, scale_format="fp32")
    b, sfb = bound["b"]
    v = spec.validate(dict(bound, b=(b, sfb[:, :1])))
    assert "float32 scales of shape [4, 1, 4], expected [4, 2, 4]" in _messages(v)
    # 128x128 block scales must be dense
    strided = torch.zeros(4, 2, 8)[:, :, ::2]
    assert "dense per group" in _messages(spec.validate(dict(bound, b=(b, strided))))
    # the recipe says per-row B scales, the tensor holds 128x128 blocks
    v = spec.validate(dict(bound, recipe=(1, 1, 128)))
    assert "expected [4, 256, 4]" in _messages(v)
    v = spec.validate(dict(bound, recipe=(1, 128, 128), recipe_a=(1, 128)))
    assert "either recipe or recipe_a" in _messages(v)
    v = spec.validate(dict(bound, recipe=(128, 128, 128)))
    assert "per token" in _messages(v)
    a, sfa = bound["a"]
    v = spec.validate(dict(bound, a=(a, sfa.to(torch.float16))))
    assert "scale dtype float16" in _messages(v)


def test_dtype_and_shape_violations():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec)
    a, sfa = bound["a"]
    v = spec.validate(dict(bound, a=(a.to(torch.bfloat16), sfa)))
    assert any(x.argument == "a[0]" and "expected float8_e4m3fn" in x.message for x in v)
    v = spec.validate(dict(bound, d=bound["d"].float()))
    assert "d: dtype float32, expected bfloat16" in _messages(v)
    v = spec.validate(dict(bound, grouped_layout=bound["grouped_layout"].long()))
    assert "dtype int64, expected int32" in _messages(v)
    v = spec.validate(dict(bound, d=bound["d"][:-1]))
    assert "d: shape" in _messages(v)
    v = spec.validate(dict(bound, d=bound["d"].t().contiguous().t()))
    assert "row-major" in _messages(v)
    v = spec.validate(dict(bound, a=a))
    assert "(data, scale) pair" in _messages(v)
    offset = torch.empty(bound["d"].numel() + 1, dtype=torch.bfloat16)[1:].view(bound["d"].shape)
    assert "16-byte aligned" in _messages(spec.validate(dict(bound, d=offset)))


def test_k_must_be_a_multiple_of_128():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec)
    (a, sfa), (b, sfb) = bound["a"], bound["b"]
    v = spec.validate(dict(bound, a=(a[:, :448], sfa), b=(b[:, :, :448], sfb)))
    assert "K = 448 is not a multiple of 128" in _messages(v)


def test_reference_and_meaningful_refuse_broken_structure():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec)
    broken = dict(bound, d=bound["d"][:, :10])
    with pytest.raises(ContractViolation, match="d: shape"):
        spec.reference(broken)
    with pytest.raises(ContractViolation):
        spec.meaningful(broken, "d")
    assert spec.meaningful(bound, "other") is None


# --- meaningful rows and tolerances --------------------------------------------------------------


def test_meaningful_masks():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec, group_sizes=[5, 0, 129, 7])
    mask = spec.meaningful(bound, "d")
    assert mask.shape == (bound["d"].shape[0], 1) and int(mask.sum()) == 141
    psum = _call(spec, group_sizes=[5, 0, 129, 7], use_psum_layout=True)
    pm = spec.meaningful(psum, "d").squeeze(1)
    assert int(pm.sum()) == 141 and bool(pm[:5].all()) and not bool(pm[5:128].any())
    masked = MGroupedFP8NTMasked()
    mb = _call(masked, group_sizes=[5, 0, 64, 7], max_m=64)
    mm = masked.meaningful(mb, "d")
    assert mm.shape == (4, 64, 1) and mm.sum(dim=(1, 2)).tolist() == [5, 0, 64, 7]


def test_tolerance_accepts_rounding_and_rejects_a_wrong_group():
    spec = MGroupedFP8NTContiguous()
    bound = _call(spec, group_sizes=[60, 70, 50, 40])
    tol = spec.tolerance(bound)
    assert tol.calc_diff == 1e-3 and tol.rtol == 2.0**-7 and tol.atol > 0
    assert MGroupedBF16NTContiguous().tolerance(_call(MGroupedBF16NTContiguous())).calc_diff == 1e-5
    ref = spec.reference(bound)["d"].float()
    mask = spec.meaningful(bound, "d").expand_as(ref)

    def passes(x):
        err = (x - ref).abs()
        return bool((err <= tol.atol + tol.rtol * ref.abs())[mask].all())

    one_ulp = ref.to(torch.bfloat16).float() * (1 + 2.0**-8)
    assert passes(one_ulp)
    wrong = ref.clone()
    wrong[128:198] = ref[0:70]  # group 1's rows computed with group 0's data
    assert not passes(wrong)


def test_recording_param_names_match_the_specs() -> None:
    """Recording names DeepGEMM arguments from a torch-free table; it must agree with the specs."""
    from kdump.kernels.deepgemm.names import deepgemm_params
    from kdump.kernels.registry import spec_for

    for name in ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked"):
        assert tuple(spec_for(f"deep_gemm:{name}").param_names()) == deepgemm_params(name)
