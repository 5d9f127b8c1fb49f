"""Planted CUDA kernels for the graph chain's shrinking-batch and changed-addresses steps
(tests/test_graph_steps_gpu.py), compiled with NVRTC through cuda-core and launched on torch's
current stream, so they capture in a CUDA graph. Each sums the rows of `x` per group:
out[g, c] = sum of x[r, c] over the rows r with groups[r] == g (one block per row, atomics; with
integer-valued x the sums are exact in any order).

- `group_sum(x, groups, out)`: the correct kernel: rows labelled < 0 are invalid and skipped.
- `group_sum_unchecked(x, groups, out)`: never skips a row: one labelled -1 adds into the row
  before `out` (out of bounds), which happens only once the batch shrinks below the captured one.
- `group_sum_described(x, groups, out)`: the correct kernel, reading its three pointers from a
  descriptor in device memory that the host writes only when the call's addresses change and
  never while a graph is being captured (as a library that keeps a TMA descriptor or workspace
  between calls). A graph captured on one set of buffers, replayed after an eager call on
  another, reads and writes that call's buffers.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

SOURCE = r"""
extern "C" __global__ void group_sum(const float* x, const int* groups, float* out, int cols) {
    const long long r = blockIdx.x;
    const int g = groups[r];
    if (g < 0) return;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        atomicAdd(&out[(long long)g * cols + c], x[r * cols + c]);
}

extern "C" __global__ void group_sum_unchecked(const float* x, const int* groups, float* out,
                                               int cols) {
    const long long r = blockIdx.x;
    const int g = groups[r];  // the bug: -1 is not skipped
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        atomicAdd(&out[(long long)g * cols + c], x[r * cols + c]);
}

extern "C" __global__ void group_sum_described(const unsigned long long* desc, int cols) {
    const float* x = (const float*)desc[0];
    const int* groups = (const int*)desc[1];
    float* out = (float*)desc[2];
    const long long r = blockIdx.x;
    const int g = groups[r];
    if (g < 0) return;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        atomicAdd(&out[(long long)g * cols + c], x[r * cols + c]);
}
"""


def _check(result: Any) -> Any:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return result[1] if len(result) == 2 else result[1:]


@functools.cache
def _module(arch: str) -> Any:
    from cuda.bindings import driver
    from cuda.core import Program, ProgramOptions

    options = ProgramOptions(arch=arch, std="c++17", lineinfo=True)
    cubin = Program(SOURCE, "c++", options).compile("cubin")
    return _check(driver.cuModuleLoadData(cubin.code))


def _launch(device: torch.device, name: str, grid: int, *params: Any) -> None:
    from cuda.bindings import driver

    if grid == 0:
        return
    major, minor = torch.cuda.get_device_capability(device)
    fn = _check(driver.cuModuleGetFunction(_module(f"sm_{major}{minor}"), name.encode()))
    array = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
    stream = torch.cuda.current_stream(device).cuda_stream
    _check(driver.cuLaunchKernel(fn, grid, 1, 1, 128, 1, 1, 0, stream, ctypes.addressof(array), 0))


def _ptr(t: torch.Tensor) -> ctypes.c_uint64:
    return ctypes.c_uint64(t.data_ptr())


def _checked(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> int:
    assert x.is_cuda and x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2
    assert groups.dtype == torch.int32 and groups.is_contiguous()
    assert groups.numel() == x.shape[0] and out.is_contiguous() and out.shape[1] == x.shape[1]
    return x.shape[1]


def group_sum(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    cols = _checked(x, groups, out)
    out.zero_()
    _launch(x.device, "group_sum", x.shape[0], _ptr(x), _ptr(groups), _ptr(out), ctypes.c_int(cols))


def group_sum_unchecked(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    cols = _checked(x, groups, out)
    out.zero_()
    _launch(
        x.device,
        "group_sum_unchecked",
        x.shape[0],
        _ptr(x),
        _ptr(groups),
        _ptr(out),
        ctypes.c_int(cols),
    )


# Per device: the addresses the descriptor holds, and the descriptor (3 pointers on the device).
_descriptors: dict[int, tuple[tuple[int, int, int] | None, torch.Tensor]] = {}


def group_sum_described(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    cols = _checked(x, groups, out)
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    held, desc = _descriptors.get(index, (None, None))  # type: ignore[arg-type]
    if desc is None:
        desc = torch.zeros(3, dtype=torch.int64, device=x.device)
    addresses = (x.data_ptr(), groups.data_ptr(), out.data_ptr())
    if held != addresses and not torch.cuda.is_current_stream_capturing():
        desc.copy_(torch.tensor(addresses, dtype=torch.int64))  # the host's descriptor upload
        held = addresses
    _descriptors[index] = (held, desc)
    out.zero_()
    _launch(x.device, "group_sum_described", x.shape[0], _ptr(desc), ctypes.c_int(cols))
