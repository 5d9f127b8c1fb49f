"""sglang's way: `deep_gemm.<name>(...)`, an attribute lookup at every call."""

from __future__ import annotations

from typing import Any

import deep_gemm


def moe_gemm(a: Any, b: Any, d: Any, layout: Any) -> None:
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout)
