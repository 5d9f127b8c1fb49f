"""The packaged kernel's planted stale-schedule bug under DeepGEMM's entry-point name, so that a
program calling it can be recorded like DeepGEMM (`-t kdump.kernels.sm120.faulty:
m_grouped_fp8_gemm_nt_contiguous`) and its bundles replay with DeepGEMM's spec on the
`packaged-faulty` backend. For checking kdump's graph, sanitizer and flight-recorder paths only.

One instance for the process: the bug lives in the schedule it keeps per (d, labels) buffer pair,
which is what a captured graph replays with.
"""

from __future__ import annotations

from typing import Any

_instance: Any = None


def m_grouped_fp8_gemm_nt_contiguous(*args: Any, **kwargs: Any) -> None:
    global _instance
    if _instance is None:
        from kdump.kernels.sm120.api import make_faulty_contiguous

        _instance = make_faulty_contiguous()
    _instance(*args, **kwargs)
