"""A module that copied the function at import: `from deep_gemm import X`."""

from __future__ import annotations

from typing import Any

from deep_gemm import m_grouped_fp8_gemm_nt_contiguous as grouped_gemm


def run(a: Any, b: Any, d: Any, layout: Any) -> None:
    grouped_gemm(a, b, d, layout)
