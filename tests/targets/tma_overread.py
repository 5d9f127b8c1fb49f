"""A planted TMA bug for replay tests: its descriptor claims more rows than the tensor has, so
the last block's bulk tensor load reads rows past the end of `x` (memcheck does not see it).

shifted_double: out[r, :] = 2 * x[r + 1, :]; the last output row is fed from the row past x.
shifted_double_8rows: out[r, :] = 2 * x[r + 8, :]; the last 8 rows (a whole box) from past x.
doubled: out = 2 * x through the same kernel with an exact descriptor (the in-bounds twin).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

BOX_ROWS = 8
COLS = 32

SOURCE = r"""
struct __align__(64) TmaDesc { unsigned long long v[16]; };

extern "C" __global__ void shifted_double(const __grid_constant__ TmaDesc tmap, float* out,
                                          int rows, int shift) {
    __shared__ __align__(128) float tile[8][32];
    __shared__ __align__(8) unsigned long long bar;
    const unsigned bar_addr = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
    const unsigned tile_addr = static_cast<unsigned>(__cvta_generic_to_shared(&tile[0][0]));
    const int b = blockIdx.x;
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar_addr));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(bar_addr), "r"(8 * 32 * 4) : "memory");
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3}], [%4];"
            :: "r"(tile_addr), "l"(reinterpret_cast<unsigned long long>(&tmap)), "r"(0),
               "r"(8 * b + shift), "r"(bar_addr)
            : "memory");
    }
    __syncthreads();
    asm volatile(
        "{\n .reg .pred p;\n WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
        " @!p bra WAIT_%=;\n}\n" :: "r"(bar_addr) : "memory");
    for (int i = threadIdx.x; i < 8 * 32; i += blockDim.x) {
        const int r = i / 32, c = i % 32, row = 8 * b + r;
        if (row < rows) out[row * 32 + c] = 2.0f * tile[r][c];
    }
}
"""


def _check(result: Any) -> Any:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return result[1] if len(result) == 2 else result[1:]


@functools.cache
def _function(arch: str) -> Any:
    from cuda.bindings import driver
    from cuda.core import Program, ProgramOptions

    cubin = Program(SOURCE, "c++", ProgramOptions(arch=arch, std="c++17", lineinfo=True)).compile(
        "cubin"
    )
    module = _check(driver.cuModuleLoadData(cubin.code))
    return _check(driver.cuModuleGetFunction(module, b"shifted_double"))


def shifted_double(x: torch.Tensor, out: torch.Tensor) -> None:
    _launch(x, out, 1)


def shifted_double_8rows(x: torch.Tensor, out: torch.Tensor) -> None:
    _launch(x, out, BOX_ROWS)


def doubled(x: torch.Tensor, out: torch.Tensor) -> None:
    _launch(x, out, 0)


def _launch(x: torch.Tensor, out: torch.Tensor, shift: int) -> None:
    """Box loads start `shift` rows down; the descriptor claims `shift` rows more than x has."""
    from cuda.bindings import driver

    rows, cols = x.shape
    assert cols == COLS and x.is_contiguous() and out.is_contiguous() and x.dtype == torch.float32
    major, minor = torch.cuda.get_device_capability(x.device)
    fn = _function(f"sm_{major}{minor}a")
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    tmap = _check(
        driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            2,
            x.data_ptr(),
            [u64(cols), u64(rows + shift)],  # the bug: `shift` rows more than x has
            [u64(cols * 4)],
            [u32(cols), u32(BOX_ROWS)],
            [u32(1), u32(1)],
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    )
    out_ptr = ctypes.c_uint64(out.data_ptr())
    n_rows = ctypes.c_int(rows)
    n_shift = ctypes.c_int(shift)
    params = (ctypes.c_void_p * 4)(
        tmap.getPtr(),
        ctypes.addressof(out_ptr),
        ctypes.addressof(n_rows),
        ctypes.addressof(n_shift),
    )
    stream = torch.cuda.current_stream(x.device).cuda_stream
    blocks = (rows + BOX_ROWS - 1) // BOX_ROWS
    _check(
        driver.cuLaunchKernel(fn, blocks, 1, 1, 128, 1, 1, 0, stream, ctypes.addressof(params), 0)
    )
