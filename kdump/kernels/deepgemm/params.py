"""Every DeepGEMM parameter kdump knows: its role, default and older names, by entry-point family.

The names and their order come from deepgemm/names.py (torch-free, shared with recording);
this module adds what replay needs. A family's own default wins over the common one (the
k-grouped functions default `compiled_dims` to "mn" and their recipe to per-32 or per-128 K).
"""

from __future__ import annotations

import inspect
from typing import Any

from kdump.kernels.deepgemm.names import deepgemm_params, params_family
from kdump.kernels.plugin import Param, Role

_EMPTY = inspect.Parameter.empty


def _p(name: str, role: Role, default: Any = _EMPTY, aliases: tuple[str, ...] = ()) -> Param:
    return Param(name, role, default, aliases)


# name -> (role, default, older names): what a parameter means wherever it appears.
_COMMON: dict[str, Param] = {
    p.name: p
    for p in (
        _p("a", Role.INPUT),
        _p("b", Role.WEIGHT),  # the experts' weights (and their scales)
        _p("d", Role.OUTPUT),
        _p("grouped_layout", Role.ROUTING, aliases=("m_indices",)),
        _p("masked_m", Role.ROUTING),
        _p("expected_m", Role.HINT),
        _p("recipe", Role.SCALAR, None),
        _p("recipe_a", Role.SCALAR, None),
        _p("recipe_b", Role.SCALAR, None),
        _p("compiled_dims", Role.HINT, "nk"),
        _p("disable_ue8m0_cast", Role.SCALAR, False),
        _p("use_psum_layout", Role.SCALAR, False),
        _p("ensure_zero_padding", Role.SCALAR, True),
        _p("expected_m_for_psum_layout", Role.HINT, None),
        # every GEMM's epilogue since 2.8; the .pyi stub spells it epilogue_class
        _p("epilogue", Role.SCALAR, None, aliases=("epilogue_class",)),
    )
}

# (family, name) -> the family's own meaning of a parameter.
_BY_FAMILY: dict[tuple[str, str], Param] = {
    # k-grouped (weight gradients): both operands are activations, K is grouped
    **{
        (fam, p.name): p
        for fam in ("k_grouped", "k_grouped_bf16")
        for p in (
            _p("b", Role.INPUT),
            # per-group K sizes on the host: ks_cpu in upstream's pybind module
            _p("ks", Role.SCALAR, aliases=("ks_cpu",)),
            # per-group K (or their prefix sums) on the device: ks_tensor in early builds
            _p("grouped_layout", Role.ROUTING, aliases=("ks_tensor",)),
            _p("c", Role.INPUT, None),
            _p("compiled_dims", Role.HINT, "mn"),
            _p("use_padded_sf_layout", Role.SCALAR, False),
        )
    },
    ("k_grouped", "recipe"): _p("recipe", Role.SCALAR, (1, 1, 128)),
    # mega-MoE: only the output is required, so that every binding form (the buffer object or
    # its parts) binds; the rest is kept as given
    **{
        (fam, p.name): p
        for fam in ("mega_moe", "bf16_mega_moe")
        for p in (
            _p("y", Role.OUTPUT),
            _p("l1_weights", Role.WEIGHT, None),
            _p("l2_weights", Role.WEIGHT, None),
            _p("sym_buffer", Role.INPUT, None),
            _p("shared_l1_weights", Role.WEIGHT, None),
            _p("shared_l2_weights", Role.WEIGHT, None),
            _p("cumulative_local_expert_recv_stats", Role.INPUT, None),
            _p("recipe", Role.SCALAR, None),
            _p("activation", Role.SCALAR, "swiglu"),
            _p("activation_clamp", Role.SCALAR, None),
            _p("fast_math", Role.SCALAR, True),
        )
    },
}

# Per-function defaults where one function of a family differs (the FP4 k-grouped recipe).
_BY_FUNCTION: dict[tuple[str, str], Param] = {
    ("k_grouped_fp4_gemm_nt_contiguous", "recipe"): _p("recipe", Role.SCALAR, (1, 1, 32)),
}


def param(function: str, name: str) -> Param:
    """What parameter `name` of entry point `function` (canonical name) means."""
    family = params_family(function)
    found = (
        _BY_FUNCTION.get((function, name)) or _BY_FAMILY.get((family, name)) or _COMMON.get(name)
    )
    if found is None:
        raise KeyError(f"{function}: parameter {name!r} has no role in kdump's table")
    return found


def params_of(function: str) -> tuple[Param, ...]:
    """The parameters of `function` (canonical name) in upstream's positional order."""
    return tuple(param(function, n) for n in deepgemm_params(function))
