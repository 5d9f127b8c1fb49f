"""Stand-in for DeepGEMM's pybind extension: callables without an inspectable signature."""

from __future__ import annotations

from typing import Any

import torch

_STATE: dict[str, Any] = {"num_sms": 132, "tc_util": 100, "pdl": False, "mk_alignment": 128}


class PybindLike:
    """Like a pybind11 function: callable, but `inspect.signature` fails on it."""

    def __init__(self, name: str, impl: Any) -> None:
        self.__name__ = name
        self.__qualname__ = name
        self._impl = impl

    @property
    def __signature__(self) -> Any:
        raise ValueError(f"no signature found for builtin {self.__name__}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<built-in method {self.__name__} of PyCapsule object>"


def _dequant_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[R, K] fp8 with per-128-K-block scales [R, ceil(K/128)] -> float32."""
    k = data.shape[-1]
    return data.float() * scale.float().repeat_interleave(128, dim=-1)[..., :k]


def _dequant_blocks(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[N, K] fp8 with 128x128 block scales [ceil(N/128), ceil(K/128)] -> float32."""
    n, k = data.shape
    full = scale.float().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return data.float() * full[:n, :k]


def _grouped_contiguous(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    d: torch.Tensor,
    grouped_layout: torch.Tensor,
    recipe: Any = None,
    compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False,
) -> None:
    if a[0].dtype != torch.float8_e4m3fn or b[0].dtype != torch.float8_e4m3fn:
        raise TypeError("m_grouped_fp8_gemm_nt_contiguous: a and b must be float8_e4m3fn")
    if d.shape != (a[0].shape[0], b[0].shape[1]):
        want = (a[0].shape[0], b[0].shape[1])
        raise ValueError(f"d has shape {tuple(d.shape)}, expected {want}")
    x = _dequant_rows(*a)
    out = torch.zeros(d.shape, dtype=torch.float32, device=d.device)
    for g in range(b[0].shape[0]):
        rows = (grouped_layout == g).nonzero().flatten()
        if rows.numel():
            out[rows] = x[rows] @ _dequant_blocks(b[0][g], b[1][g]).T
    d.copy_(out.to(d.dtype))  # -1 rows are written as zeros (the SM90 behaviour)


def _setter(key: str) -> Any:
    def set_value(value: Any) -> None:
        _STATE[key] = value

    return set_value


def _getter(key: str) -> Any:
    return lambda: _STATE[key]


m_grouped_fp8_fp4_gemm_nt_contiguous = PybindLike(
    "m_grouped_fp8_fp4_gemm_nt_contiguous", _grouped_contiguous
)
set_num_sms = PybindLike("set_num_sms", _setter("num_sms"))
get_num_sms = PybindLike("get_num_sms", _getter("num_sms"))
set_tc_util = PybindLike("set_tc_util", _setter("tc_util"))
get_tc_util = PybindLike("get_tc_util", _getter("tc_util"))
set_ignore_compile_dims = PybindLike("set_ignore_compile_dims", _setter("ignore_compile_dims"))
# A setter without a getter here (as in builds whose getter is not exported).
set_mk_alignment_for_contiguous_layout = PybindLike(
    "set_mk_alignment_for_contiguous_layout", _setter("mk_alignment")
)
