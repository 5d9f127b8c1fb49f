"""Callables that drive the packaged kernel's failure paths on the CPU, replayed as generic
targets by tests/test_sm120_build.py (in-process, so the tests' monkeypatches apply)."""

from __future__ import annotations

import torch

from kdump.kernels.sm120 import api, build, configs


def compile_packaged(x: torch.Tensor) -> None:
    """Build the packaged kernel for sm_120a (no cache), then touch x so the call has an output."""
    build.build_cubin(build.BuildRequest("sm_120a", configs.CONFIGS[120]), use_cache=False)
    x.add_(1)


def call_packaged(a, b, d: torch.Tensor, grouped_layout: torch.Tensor) -> None:
    api.m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout)
