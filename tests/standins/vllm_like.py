"""vLLM's way: the function is cached in this module's globals on first use."""

from __future__ import annotations

from typing import Any

_grouped_impl: Any = None


def _lazy_init() -> None:
    global _grouped_impl
    if _grouped_impl is None:
        import deep_gemm

        _grouped_impl = deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous


def m_grouped_fp8_gemm_nt_contiguous(a: Any, b: Any, d: Any, layout: Any) -> None:
    _lazy_init()
    _grouped_impl(a, b, d, layout)
