"""Canonical entry-point ids, their alias tables and parameter tables (recording and replay).

A recorded call carries the canonical id of what was called plus the name it was called by, so a
call recorded under any alias replays through the same spec. DeepGEMM's lines (upstream 2.x,
tokenspeed-deepgemm, sgl-deep-gemm, deepinfer-gemm, vLLM's vendored copy, nv_dev wheels) agree on
the names but not on every parameter: the tables here are the union in upstream's order, and a
call binds by the parameter names of the build that ran it (deepgemm/signature.py) where known.
Torch-free: the recorder imports it inside the recorded program.
"""

from __future__ import annotations

# Modules that bind DeepGEMM's API: upstream and its repackagings, vLLM's vendored copy.
DEEPGEMM_MODULES: tuple[str, ...] = ("deep_gemm", "vllm.third_party.deep_gemm")

# canonical function name -> other names of the same entry point (newer fp8_fp4 names, the FP4
# names that alias the same functions since 2.8, legacy names).
DEEPGEMM_ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "m_grouped_fp8_gemm_nt_contiguous": (
        "m_grouped_fp8_fp4_gemm_nt_contiguous",
        "m_grouped_fp4_gemm_nt_contiguous",
        "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    ),
    "m_grouped_fp8_gemm_nn_contiguous": ("m_grouped_fp8_fp4_gemm_nn_contiguous",),
    "m_grouped_fp8_gemm_nt_masked": (
        "m_grouped_fp8_fp4_gemm_nt_masked",
        "m_grouped_fp4_gemm_nt_masked",
        "fp8_m_grouped_gemm_nt_masked",
        "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
    ),
    "m_grouped_bf16_gemm_nt_contiguous": (),
    "m_grouped_bf16_gemm_nn_contiguous": (),
    "m_grouped_bf16_gemm_nt_masked": ("bf16_m_grouped_gemm_nt_masked",),
    "k_grouped_fp8_gemm_nt_contiguous": (),
    "k_grouped_fp8_gemm_tn_contiguous": (),
    "k_grouped_fp4_gemm_nt_contiguous": (),  # an entry point of its own, not an FP8 alias
    "k_grouped_bf16_gemm_tn_contiguous": (),
}

# The fused mega-MoE kernels: they read and write other ranks' symmetric memory through raw
# pointers, so they are recorded (the pointers as opaque addresses) but never replayed.
DEEPGEMM_MEGA_MOE: tuple[str, ...] = (
    "fp8_fp4_mega_moe",
    "bf16_mega_moe",
    "fp8_mega_moe",
    "fp4_fp4_mega_moe",
    "nvfp4_mega_moe",
)
# Parameters of the mega-MoE functions that hold raw addresses of other ranks' buffers.
MEGA_MOE_POINTER_PARAMS: tuple[str, ...] = ("sym_buffer_ptrs",)

# DeepGEMM's process-global setters: hooked so that bundles know the settings in force. The
# locality-domain calls place weights in the GPU's locality domains (and start or stop the
# MLOPart localizer): global state too, noted by a summary of their arguments.
DEEPGEMM_LOCALITY_CALLS: tuple[str, ...] = ("localize", "localize_rows", "destroy_localizer")
DEEPGEMM_SETTERS: tuple[str, ...] = (
    "set_num_sms",
    "set_tc_util",
    "set_pdl",
    "set_mk_alignment_for_contiguous_layout",
    "set_ignore_compile_dims",
    "set_block_size_multiple_of",
    "use_deterministic_algorithms",
    *DEEPGEMM_LOCALITY_CALLS,
)
# setting name (the key recorded state and KernelSpec.with_settings use) -> its setter.
DEEPGEMM_SETTINGS: dict[str, str] = {
    "num_sms": "set_num_sms",
    "tc_util": "set_tc_util",
    "pdl": "set_pdl",
    "mk_alignment": "set_mk_alignment_for_contiguous_layout",
    "ignore_compile_dims": "set_ignore_compile_dims",
    "block_size_multiple_of": "set_block_size_multiple_of",
    "deterministic_algorithms": "use_deterministic_algorithms",
}
DEEPGEMM_GETTERS: dict[str, str] = {
    "num_sms": "get_num_sms",
    "tc_util": "get_tc_util",
    "pdl": "get_pdl",
    "mk_alignment": "get_mk_alignment_for_contiguous_layout",
    "deterministic_algorithms": "get_deterministic_algorithms",
}

# Parameter names by entry-point family, in upstream's positional order (2.8: `epilogue` last,
# k-grouped `ks_cpu` spelled `ks` as most lines do). The specs carry the same names with roles
# and defaults (a test keeps the two in step); older names are aliases (deepgemm/specs.py).
_RECIPES = ("recipe", "recipe_a", "recipe_b")
DEEPGEMM_PARAMS: dict[str, tuple[str, ...]] = {
    "fp8_contiguous": (
        *("a", "b", "d", "grouped_layout", *_RECIPES, "compiled_dims", "disable_ue8m0_cast"),
        *("use_psum_layout", "ensure_zero_padding", "expected_m_for_psum_layout", "epilogue"),
    ),
    "fp8_nn_contiguous": (
        *("a", "b", "d", "grouped_layout", *_RECIPES, "compiled_dims", "disable_ue8m0_cast"),
        *("use_psum_layout", "ensure_zero_padding", "epilogue"),
    ),
    "fp8_masked": (
        *("a", "b", "d", "masked_m", "expected_m", *_RECIPES, "compiled_dims"),
        *("disable_ue8m0_cast", "epilogue"),
    ),
    "bf16_contiguous": (
        *("a", "b", "d", "grouped_layout", "compiled_dims", "use_psum_layout"),
        *("ensure_zero_padding", "expected_m_for_psum_layout", "epilogue"),
    ),
    "bf16_nn_contiguous": (
        *("a", "b", "d", "grouped_layout", "compiled_dims", "use_psum_layout"),
        *("ensure_zero_padding", "epilogue"),
    ),
    "bf16_masked": ("a", "b", "d", "masked_m", "expected_m", "compiled_dims", "epilogue"),
    "k_grouped": (
        *("a", "b", "d", "ks", "grouped_layout", "c", "recipe", "compiled_dims"),
        *("use_psum_layout", "use_padded_sf_layout", "epilogue"),
    ),
    "k_grouped_bf16": (
        *("a", "b", "d", "ks", "grouped_layout", "c", "compiled_dims", "use_psum_layout"),
        *("use_padded_sf_layout", "epilogue"),
    ),
    # the Python-level mega-MoE functions of the 2.8.2 lines (the symmetric buffer object);
    # builds that pass the buffer's parts (sym_buffer, sym_buffer_ptrs, rank_idx, ...) and
    # newer keywords bind by their runtime names
    "mega_moe": (
        *("y", "l1_weights", "l2_weights", "sym_buffer", "shared_l1_weights", "shared_l2_weights"),
        *("cumulative_local_expert_recv_stats", "recipe", "activation", "activation_clamp"),
        "fast_math",
    ),
    "bf16_mega_moe": (
        *("y", "l1_weights", "l2_weights", "sym_buffer", "shared_l1_weights", "shared_l2_weights"),
        *("cumulative_local_expert_recv_stats", "activation", "activation_clamp", "fast_math"),
    ),
}


def params_family(function_name: str) -> str:
    """The DEEPGEMM_PARAMS key of an entry point (canonical or alias name)."""
    name = canonical_name(function_name)
    if name in DEEPGEMM_MEGA_MOE:
        return "bf16_mega_moe" if name.startswith("bf16") else "mega_moe"
    if name.startswith("k_grouped"):
        return "k_grouped_bf16" if "bf16" in name else "k_grouped"
    kind = "bf16" if "bf16" in name else "fp8"
    if "masked" in name:
        return f"{kind}_masked"
    return f"{kind}_nn_contiguous" if "_nn_" in name else f"{kind}_contiguous"


def deepgemm_params(function_name: str) -> tuple[str, ...]:
    """Positional parameter names of a DeepGEMM entry point in upstream's order."""
    return DEEPGEMM_PARAMS[params_family(function_name)]


_ALIAS_TO_CANONICAL: dict[str, str] = {}
for _canon, _aliases in DEEPGEMM_ENTRY_POINTS.items():
    _ALIAS_TO_CANONICAL[_canon] = _canon
    for _a in _aliases:
        _ALIAS_TO_CANONICAL[_a] = _canon
for _mega in DEEPGEMM_MEGA_MOE:
    _ALIAS_TO_CANONICAL[_mega] = _mega

# Every function name the plug-in claims (entry points, aliases, mega-MoE kernels).
KNOWN_FUNCTIONS: frozenset[str] = frozenset(_ALIAS_TO_CANONICAL)


def canonical_name(function_name: str) -> str:
    return _ALIAS_TO_CANONICAL.get(function_name, function_name)


def deepgemm_id(function_name: str) -> str:
    """'deep_gemm:<canonical name>' for any known DeepGEMM entry-point name."""
    return f"deep_gemm:{canonical_name(function_name)}"


def aliases_of(function_name: str) -> tuple[str, ...]:
    """The other names of an entry point (empty for the mega-MoE kernels)."""
    return DEEPGEMM_ENTRY_POINTS.get(canonical_name(function_name), ())
