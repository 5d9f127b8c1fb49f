"""Stand-in for upstream DeepGEMM's package: re-exports `_C` callables, with aliases."""

from __future__ import annotations

from deep_gemm._C import (
    get_num_sms,
    get_tc_util,
    m_grouped_fp8_fp4_gemm_nt_contiguous,
    set_ignore_compile_dims,
    set_mk_alignment_for_contiguous_layout,
    set_num_sms,
    set_tc_util,
)

__version__ = "0.0.0+kdump.standin"

# Upstream binds the fp8 name to the fp8_fp4 function object: an alias pair.
m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_fp4_gemm_nt_contiguous

__all__ = [
    "get_num_sms",
    "get_tc_util",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_contiguous",
    "set_ignore_compile_dims",
    "set_mk_alignment_for_contiguous_layout",
    "set_num_sms",
    "set_tc_util",
]
