"""Specs of DeepGEMM's mega-MoE kernels: recorded, never replayed.

`fp8_fp4_mega_moe`, `bf16_mega_moe` (and `fp8_mega_moe`, `fp4_fp4_mega_moe`, `nvfp4_mega_moe`)
fuse EP dispatch, both expert GEMMs and EP combine into one kernel that reads and writes the
symmetric memory of every rank. The Python API takes the symmetric buffer object; the bindings
below it take its parts, among them `sym_buffer_ptrs`, the raw addresses of the other ranks'
buffers. A recording keeps the call (its tensors, and those addresses marked as opaque
pointers, TargetSpec.pointer_params), so a report shows what ran and with what routing; a
replay refuses it with one line (deepgemm/refusal.py): the other ranks' memory is not in the
bundle, and their processes are gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kdump.kernels.deepgemm.names import DEEPGEMM_MEGA_MOE, deepgemm_id
from kdump.kernels.deepgemm.params import params_of
from kdump.kernels.deepgemm.refusal import mega_moe_refusal
from kdump.kernels.deepgemm.runtime_bound import RuntimeBound
from kdump.kernels.plugin import KernelSpec


class MegaMoESpec(RuntimeBound, KernelSpec):
    """One mega-MoE entry point (`function`)."""

    def __init__(self, function: str) -> None:
        self.function = function
        self.id = deepgemm_id(function)
        self.aliases = ()
        self.params = params_of(function)

    def library(self) -> str | None:
        return "deep_gemm"

    def refusal(self, bound: Mapping[str, Any]) -> str | None:
        return mega_moe_refusal(self.id, dict(bound))


def mega_moe_specs() -> tuple[MegaMoESpec, ...]:
    return tuple(MegaMoESpec(f) for f in DEEPGEMM_MEGA_MOE)
