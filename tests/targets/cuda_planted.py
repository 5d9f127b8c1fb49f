"""Planted CUDA bugs for GPU replay tests, compiled with NVRTC and launched on torch's stream.

- `neighbour_sum(x, out)`: out[i] = x[i] + x[i+1 within the block], staged through shared memory
  WITHOUT the barrier between the write and the read: a shared-memory race that racecheck names
  (the result is often right anyway: run-to-run differences are not guaranteed).
- `double_rows(x, labels, out)`: the clean kernel (out[r] = 2 x[r] for labelled rows).
- `workspace_double(x, labels, out)`: the capture-unsafe class. A scratch buffer is sized from
  the routing of the FIRST call for a given `out` and kept; the compaction kernel writes every
  labelled row into it without a bounds check, and the copy-back kernel's grid is that first
  call's row count (frozen into a captured graph). A later call with more labelled rows writes
  past the scratch buffer and leaves the extra output rows unwritten.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

SOURCE = r"""
extern "C" __global__ void neighbour_sum(const float* x, float* out, int n) {
    __shared__ float tile[256];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = i < n ? x[i] : 0.0f;
    // the bug: no __syncthreads() here
    const int j = (threadIdx.x + 1) % blockDim.x;
    if (i < n) out[i] = tile[threadIdx.x] + tile[j];
}

// One block per row: out[r] = 2 x[r] for labelled rows (the clean kernel: no state, no scratch).
extern "C" __global__ void double_rows(const float* x, const int* labels, float* out, int cols) {
    const int r = blockIdx.x;
    if (labels[r] < 0) return;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[(long long)r * cols + c] = 2.0f * x[(long long)r * cols + c];
}

// One block per row: labelled rows are compacted into `scratch` (no bounds check: the bug).
extern "C" __global__ void compact_rows(const float* x, const int* labels, float* scratch,
                                        int* row_of, int* counter, int cols) {
    __shared__ int pos;
    const int r = blockIdx.x;
    if (labels[r] < 0) return;
    if (threadIdx.x == 0) {
        pos = atomicAdd(counter, 1);
        row_of[pos] = r;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        scratch[(long long)pos * cols + c] = 2.0f * x[(long long)r * cols + c];
}

// One block per compacted row: the grid is the first call's row count.
extern "C" __global__ void scatter_rows(const float* scratch, const int* row_of, float* out,
                                        int cols) {
    const int p = blockIdx.x;
    const int r = row_of[p];
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[(long long)r * cols + c] = scratch[(long long)p * cols + c];
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

    cubin = Program(SOURCE, "c++", ProgramOptions(arch=arch, std="c++17", lineinfo=True)).compile(
        "cubin"
    )
    return _check(driver.cuModuleLoadData(cubin.code))


def _launch(device: torch.device, name: str, grid: int, block: int, *params: Any) -> None:
    from cuda.bindings import driver

    major, minor = torch.cuda.get_device_capability(device)
    fn = _check(driver.cuModuleGetFunction(_module(f"sm_{major}{minor}"), name.encode()))
    array = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
    stream = torch.cuda.current_stream(device).cuda_stream
    _check(
        driver.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream, ctypes.addressof(array), 0)
    )


def _ptr(t: torch.Tensor) -> ctypes.c_uint64:
    return ctypes.c_uint64(t.data_ptr())


def neighbour_sum(x: torch.Tensor, out: torch.Tensor) -> None:
    assert x.is_cuda and x.dtype == torch.float32 and x.is_contiguous() and out.is_contiguous()
    n = x.numel()
    _launch(x.device, "neighbour_sum", (n + 255) // 256, 256, _ptr(x), _ptr(out), ctypes.c_int(n))


def double_rows(x: torch.Tensor, labels: torch.Tensor, out: torch.Tensor) -> None:
    """out[r] = 2 * x[r] for rows with labels[r] >= 0: workspace_double without its bug."""
    assert x.is_cuda and x.dtype == torch.float32 and labels.dtype == torch.int32
    rows, cols = x.shape
    _launch(
        x.device, "double_rows", rows, 128, _ptr(x), _ptr(labels), _ptr(out), ctypes.c_int(cols)
    )


# Per `out` pointer: (scratch address, row map, counter, rows the scratch holds). The scratch is
# the library's own allocation (cuMemAlloc, outside torch's allocator), as a real library's
# workspace would be: writes past it never land in the replay's tensors.
_scratch: dict[int, tuple[int, torch.Tensor, torch.Tensor, int]] = {}


def workspace_double(x: torch.Tensor, labels: torch.Tensor, out: torch.Tensor) -> None:
    """out[r] = 2 * x[r] for rows with labels[r] >= 0 (other rows untouched)."""
    assert x.is_cuda and x.dtype == torch.float32 and labels.dtype == torch.int32
    rows, cols = x.shape
    kept = _scratch.get(out.data_ptr())
    if kept is None:
        from cuda.bindings import driver

        n = int((labels >= 0).sum())  # host sync: only on the first call for this `out`
        scratch = int(_check(driver.cuMemAlloc(max(n, 1) * cols * 4)))
        row_of = torch.empty(rows, dtype=torch.int32, device=x.device)
        counter = torch.zeros(1, dtype=torch.int32, device=x.device)
        kept = _scratch[out.data_ptr()] = (scratch, row_of, counter, n)
    scratch, row_of, counter, n = kept
    counter.zero_()
    _launch(
        x.device,
        "compact_rows",
        rows,
        128,
        _ptr(x),
        _ptr(labels),
        ctypes.c_uint64(scratch),
        _ptr(row_of),
        _ptr(counter),
        ctypes.c_int(cols),
    )
    if n:
        _launch(
            x.device,
            "scatter_rows",
            n,
            128,
            ctypes.c_uint64(scratch),
            _ptr(row_of),
            _ptr(out),
            ctypes.c_int(cols),
        )
