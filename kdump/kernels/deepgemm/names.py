"""Canonical entry-point ids and their alias tables (shared by recording and replay).

A recorded call carries the canonical id of what was called plus the name it was called by, so a
call recorded under any alias replays through the same spec.
"""

from __future__ import annotations

# Modules that bind DeepGEMM's API: upstream, vLLM's vendored copy.
DEEPGEMM_MODULES: tuple[str, ...] = ("deep_gemm", "vllm.third_party.deep_gemm")

# canonical function name -> other names of the same entry point (newer fp8_fp4 names, legacy).
DEEPGEMM_ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "m_grouped_fp8_gemm_nt_contiguous": (
        "m_grouped_fp8_fp4_gemm_nt_contiguous",
        "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    ),
    "m_grouped_fp8_gemm_nn_contiguous": ("m_grouped_fp8_fp4_gemm_nn_contiguous",),
    "m_grouped_fp8_gemm_nt_masked": (
        "m_grouped_fp8_fp4_gemm_nt_masked",
        "fp8_m_grouped_gemm_nt_masked",
        "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    ),
    "m_grouped_bf16_gemm_nt_contiguous": (),
    "m_grouped_bf16_gemm_nn_contiguous": (),
    "m_grouped_bf16_gemm_nt_masked": (),
    "k_grouped_fp8_gemm_nt_contiguous": (),
    "k_grouped_fp8_gemm_tn_contiguous": (),
    "k_grouped_bf16_gemm_tn_contiguous": (),
}

# DeepGEMM's process-global setters: hooked so that bundles know the settings in force.
DEEPGEMM_SETTERS: tuple[str, ...] = (
    "set_num_sms",
    "set_tc_util",
    "set_pdl",
    "set_mk_alignment_for_contiguous_layout",
    "set_ignore_compile_dims",
    "set_block_size_multiple_of",
)
# setting name (the key recorded state and KernelSpec.with_settings use) -> its setter.
DEEPGEMM_SETTINGS: dict[str, str] = {
    "num_sms": "set_num_sms",
    "tc_util": "set_tc_util",
    "pdl": "set_pdl",
    "mk_alignment": "set_mk_alignment_for_contiguous_layout",
    "ignore_compile_dims": "set_ignore_compile_dims",
    "block_size_multiple_of": "set_block_size_multiple_of",
}
DEEPGEMM_GETTERS: dict[str, str] = {
    "num_sms": "get_num_sms",
    "tc_util": "get_tc_util",
    "pdl": "get_pdl",
    "mk_alignment": "get_mk_alignment_for_contiguous_layout",
}

# DeepGEMM's parameter names by entry-point family. Recording needs them without
# importing torch (pybind bindings hide their signatures); the specs in deepgemm/specs.py carry
# the same names with roles and defaults (a test keeps the two in step).
DEEPGEMM_PARAMS: dict[str, tuple[str, ...]] = {
    "contiguous": (
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
    ),
    "masked": (
        "a",
        "b",
        "d",
        "masked_m",
        "expected_m",
        "recipe",
        "recipe_a",
        "recipe_b",
        "compiled_dims",
        "disable_ue8m0_cast",
    ),
    "k_grouped": ("a", "b", "d", "ks", "ks_tensor", "c", "recipe", "compiled_dims"),
}


def deepgemm_params(function_name: str) -> tuple[str, ...]:
    """Positional parameter names of a DeepGEMM entry point (canonical name)."""
    if function_name.startswith("k_grouped"):
        return DEEPGEMM_PARAMS["k_grouped"]
    return DEEPGEMM_PARAMS["masked" if "masked" in function_name else "contiguous"]


_ALIAS_TO_CANONICAL: dict[str, str] = {}
for _canon, _aliases in DEEPGEMM_ENTRY_POINTS.items():
    _ALIAS_TO_CANONICAL[_canon] = _canon
    for _a in _aliases:
        _ALIAS_TO_CANONICAL[_a] = _canon


def deepgemm_id(function_name: str) -> str:
    """'deep_gemm:<canonical name>' for any known DeepGEMM entry-point name."""
    return f"deep_gemm:{_ALIAS_TO_CANONICAL.get(function_name, function_name)}"
