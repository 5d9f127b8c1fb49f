"""A planted wrong DeepGEMM build (tests/targets/planted_gemm.py, bug "routing")."""

from __future__ import annotations

from typing import Any

from targets.planted_gemm import grouped_contiguous

__version__ = "0.0.0+kdump.planted"


def m_grouped_fp8_fp4_gemm_nt_contiguous(*args: Any, **kwargs: Any) -> None:
    grouped_contiguous("routing", *args, **kwargs)


m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_fp4_gemm_nt_contiguous
