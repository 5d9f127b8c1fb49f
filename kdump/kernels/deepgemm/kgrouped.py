"""Specs of DeepGEMM's k-grouped GEMMs (weight gradients of MoE layers).

D[g] (+ C[g]) = A_gᵀ B_g for each group g, where group g owns its own stretch of the K
dimension: `ks` lists each group's K on the host (`ks_cpu` in upstream's pybind module),
`grouped_layout` holds them on the device (int32 [G]; their prefix sums with
`use_psum_layout=True`), and `use_padded_sf_layout=True` (sgl-deep-gemm) says the packed
scales cover each group's K padded to the alignment instead of compactly. D is [G, M, N].

The spec binds (by the runtime signature, deepgemm/runtime_bound.py), names the output and
checks what the keywords must hold: whole groups that agree in number, int32 layouts, bools.
It has no torch reference: a replay compares with the recorded output and a fresh run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kdump.kernels.deepgemm.names import deepgemm_id
from kdump.kernels.deepgemm.params import params_of
from kdump.kernels.deepgemm.runtime_bound import RuntimeBound
from kdump.kernels.plugin import KernelSpec, Violation


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tensor(x: Any) -> Any:
    """The data tensor of an operand (a tensor, or the first of a (data, scale) pair)."""
    if isinstance(x, (tuple, list)) and x:
        x = x[0]
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else None


class _KGroupedSpec(RuntimeBound, KernelSpec):
    function: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.id = deepgemm_id(cls.function)
        cls.aliases = ()
        cls.params = params_of(cls.function)

    def library(self) -> str | None:
        return "deep_gemm"

    def validate(self, bound: Mapping[str, Any]) -> list[Violation]:
        out: list[Violation] = []
        for name in ("use_psum_layout", "use_padded_sf_layout"):
            if not isinstance(bound.get(name), bool):
                out.append(Violation(name, f"expected a bool, got {bound.get(name)!r}"))
        ks = bound.get("ks")
        ks_list = self._ks(ks, out)
        layout = bound.get("grouped_layout")
        d = _tensor(bound.get("d"))
        groups = None
        if d is not None:
            if len(d.shape) != 3:
                out.append(Violation("d", f"has {len(d.shape)} dimensions, expected 3 [G, M, N]"))
            else:
                groups = int(d.shape[0])
        if _tensor(layout) is not None:
            if str(layout.dtype) != "torch.int32":
                out.append(Violation("grouped_layout", f"dtype {layout.dtype}, expected int32"))
            if len(layout.shape) != 1 or (groups is not None and layout.shape[0] != groups):
                want = f"[{groups}]" if groups is not None else "[G]"
                shown = list(layout.shape)
                out.append(Violation("grouped_layout", f"shape {shown}, expected {want}"))
        if ks_list is not None and groups is not None and ks_list and len(ks_list) != groups:
            out.append(Violation("ks", f"{len(ks_list)} groups, d has {groups}"))
        if (ks is None or ks_list == []) and bound.get("use_psum_layout") is False:
            out.append(
                Violation("ks", "no per-group K on the host: give ks, or use_psum_layout=True")
            )
        return out

    @staticmethod
    def _ks(ks: Any, out: list[Violation]) -> list[int] | None:
        if ks is None:
            return None
        if not isinstance(ks, (list, tuple)) or not all(_is_int(k) for k in ks):
            out.append(Violation("ks", f"expected a list of ints, got {type(ks).__name__}"))
            return None
        if any(k < 0 for k in ks):
            out.append(Violation("ks", f"negative K in {list(ks)[:8]}"))
        return [int(k) for k in ks]


class KGroupedFP8NTContiguous(_KGroupedSpec):
    function = "k_grouped_fp8_gemm_nt_contiguous"


class KGroupedFP8TNContiguous(_KGroupedSpec):
    function = "k_grouped_fp8_gemm_tn_contiguous"


class KGroupedFP4NTContiguous(_KGroupedSpec):
    function = "k_grouped_fp4_gemm_nt_contiguous"


class KGroupedBF16TNContiguous(_KGroupedSpec):
    function = "k_grouped_bf16_gemm_tn_contiguous"


SPEC_CLASSES: tuple[type[_KGroupedSpec], ...] = (
    KGroupedFP8NTContiguous,
    KGroupedFP8TNContiguous,
    KGroupedFP4NTContiguous,
    KGroupedBF16TNContiguous,
)
