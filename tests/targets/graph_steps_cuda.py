"""Planted CUDA kernels for the graph chain's shrinking-batch and changed-addresses steps
(tests/test_graph_steps_gpu.py), compiled with NVRTC through cuda-core and launched on torch's
current stream, so they capture in a CUDA graph. Each gathers the last row of every group, as a
draft model gathers each sequence's last token: out[g] = x[r] for the row r labelled g whose
successor is in another group (or that is the last row); rows labelled < 0 are invalid. `out` is
zeroed first, so a group without rows gives a zero row.

- `last_rows(x, groups, out)`: the correct kernel: invalid rows are skipped.
- `last_rows_unchecked(x, groups, out)`: does not skip invalid rows: the last of a run of rows
  labelled -1 is stored into the row before `out` (out of bounds). That happens only once the
  batch shrinks below the captured one (every row is valid at capture).
- `last_rows_described(x, groups, out)`: the correct kernel, reading its three pointers from a
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
__device__ void gather_last(const float* x, const int* groups, float* out, int rows, int cols,
                            bool check) {
    const int r = blockIdx.x;
    const int g = groups[r];
    if (check && g < 0) return;  // the unchecked kernel's bug: -1 is not skipped
    if (r + 1 < rows && groups[r + 1] == g) return;  // not the last row of its group
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[(long long)g * cols + c] = x[(long long)r * cols + c];
}

extern "C" __global__ void last_rows(const float* x, const int* groups, float* out, int rows,
                                     int cols) {
    gather_last(x, groups, out, rows, cols, true);
}

extern "C" __global__ void last_rows_unchecked(const float* x, const int* groups, float* out,
                                               int rows, int cols) {
    gather_last(x, groups, out, rows, cols, false);
}

extern "C" __global__ void last_rows_described(const unsigned long long* desc, int rows,
                                               int cols) {
    gather_last((const float*)desc[0], (const int*)desc[1], (float*)desc[2], rows, cols, true);
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


def _rows(name: str, x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    cols = _checked(x, groups, out)
    out.zero_()
    rows = ctypes.c_int(x.shape[0])
    _launch(x.device, name, x.shape[0], _ptr(x), _ptr(groups), _ptr(out), rows, ctypes.c_int(cols))


def last_rows(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    _rows("last_rows", x, groups, out)


def last_rows_unchecked(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
    _rows("last_rows_unchecked", x, groups, out)


# Per device: the addresses the descriptor holds, and the descriptor (3 pointers on the device).
_descriptors: dict[int, tuple[tuple[int, int, int] | None, torch.Tensor]] = {}


def last_rows_described(x: torch.Tensor, groups: torch.Tensor, out: torch.Tensor) -> None:
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
    rows = ctypes.c_int(x.shape[0])
    _launch(x.device, "last_rows_described", x.shape[0], _ptr(desc), rows, ctypes.c_int(cols))
