"""Loading the cubin and launching its kernels through cuda.bindings.driver.

Launch parameters are a plain ctypes struct (KdParams) that mirrors `kd::Params` in
grouped_gemm.cu field by field, plus two TMA descriptors passed by value. Everything is enqueued
on torch's current stream with no host synchronisation and no allocation, so a launch can be
captured into a CUDA graph.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kdump.cuda.nvrtc import LaunchError, check, check_nvrtc_vs_driver, driver

from .build import KERNEL_NAMES, BuildRequest, build_cubin
from .configs import TileConfig, arch_family, config_for

if TYPE_CHECKING:
    import torch


class KdParams(ctypes.Structure):
    """Mirror of kd::Params (same order, same types; 136 bytes)."""

    _fields_ = [
        ("sfa", ctypes.c_void_p),
        ("sfb", ctypes.c_void_p),
        ("layout", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("sched", ctypes.c_void_p),
        ("sfa_stride_g", ctypes.c_int64),
        ("sfa_stride_m", ctypes.c_int64),
        ("sfa_stride_k", ctypes.c_int64),
        ("sfb_stride_g", ctypes.c_int64),
        ("sfb_stride_n", ctypes.c_int64),
        ("sfb_stride_k", ctypes.c_int64),
        ("d_stride_g", ctypes.c_int64),
        ("d_stride_m", ctypes.c_int64),
        ("m", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("num_groups", ctypes.c_int32),
        ("m_tiles", ctypes.c_int32),
        ("n_tiles", ctypes.c_int32),
        ("k_blocks", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


_driver = driver
_check = check
PackagedLaunchError = LaunchError


@dataclass
class LoadedModule:
    module: Any
    functions: dict[str, Any]
    config: TileConfig
    arch: str


_modules: dict[tuple[int, str], LoadedModule] = {}
_lock = threading.Lock()


def arch_for(cc: tuple[int, int]) -> str:
    arch_family(cc)  # raises for unsupported GPUs
    return f"sm_{cc[0]}{cc[1]}a"


def get_module(device: torch.device) -> LoadedModule:
    """Build (or fetch from the cache) and load the cubin for `device`, once per process."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = torch.cuda.get_device_capability(index)
    arch = arch_for(cc)
    key = (index, arch)
    with _lock:
        if key in _modules:
            return _modules[key]
        check_nvrtc_vs_driver()
        config = config_for(cc)
        cubin = build_cubin(BuildRequest(arch, config)).cubin
        driver = _driver()
        _check(driver.cuInit(0), "cuInit")
        # torch created (and made current) the device's primary context; load into that one.
        with torch.cuda.device(index):
            # torch works in the device's primary context; make sure it is current here.
            ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
            if not int(ctx):
                cu_dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
                ctx = _check(driver.cuDevicePrimaryCtxRetain(cu_dev), "cuDevicePrimaryCtxRetain")
                _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            functions = {}
            for name in KERNEL_NAMES:
                fn = _check(driver.cuModuleGetFunction(module, name.encode()), f"get {name}")
                if name.startswith("kd_gemm"):
                    _check(
                        driver.cuFuncSetAttribute(
                            fn,
                            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            config.dynamic_smem,
                        ),
                        f"raise the dynamic shared memory of {name}",
                    )
                functions[name] = fn
        loaded = LoadedModule(module, functions, config, arch)
        _modules[key] = loaded
        return loaded


# L2 promotion in bytes -> the suffix of its CUtensorMapL2promotion member.
_L2_PROMOTION = {0: "NONE", 64: "L2_64B", 128: "L2_128B", 256: "L2_256B"}


def encode_tma_3d(
    ptr: int,
    dims: tuple[int, int, int],
    strides_bytes: tuple[int, int],
    box: tuple[int, int],
    l2_promotion: int = 256,
) -> Any:
    """A 3-D UINT8 descriptor: dims = (K, rows, groups) innermost first, box = (128, rows) with the
    128-byte swizzle the kernel's ldmatrix addressing expects; out-of-bounds reads zero-fill."""
    driver = _driver()
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    return _check(
        driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
            3,
            ptr,
            [u64(dims[0]), u64(dims[1]), u64(dims[2])],
            [u64(strides_bytes[0]), u64(strides_bytes[1])],
            [u32(box[0]), u32(box[1]), u32(1)],
            [u32(1), u32(1), u32(1)],
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            getattr(
                driver.CUtensorMapL2promotion,
                f"CU_TENSOR_MAP_L2_PROMOTION_{_L2_PROMOTION[l2_promotion]}",
            ),
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ),
        "cuTensorMapEncodeTiled",
    )


def launch_gemm(
    mod: LoadedModule,
    kernel: str,
    tmap_a: Any,
    tmap_b: Any,
    params: KdParams,
    grid: int,
    stream: int,
) -> None:
    if grid <= 0:
        return
    driver = _driver()
    args = (ctypes.c_void_p * 3)(tmap_a.getPtr(), tmap_b.getPtr(), ctypes.addressof(params))
    _check(
        driver.cuLaunchKernel(
            mod.functions[kernel],
            grid,
            1,
            1,
            mod.config.threads,
            1,
            1,
            mod.config.dynamic_smem,
            driver.CUstream(stream),
            ctypes.addressof(args),
            0,
        ),
        f"cuLaunchKernel({kernel})",
    )


def launch_plan(mod: LoadedModule, labels_ptr: int, m_tiles: int, ws_ptr: int, stream: int) -> None:
    """One warp writes the stale schedule (fault injection only)."""
    driver = _driver()
    vals = (ctypes.c_void_p(labels_ptr), ctypes.c_int32(m_tiles), ctypes.c_void_p(ws_ptr))
    args = (ctypes.c_void_p * 3)(*(ctypes.addressof(v) for v in vals))
    _check(
        driver.cuLaunchKernel(
            mod.functions["kd_plan_stale_schedule"],
            1,
            1,
            1,
            32,
            1,
            1,
            0,
            driver.CUstream(stream),
            ctypes.addressof(args),
            0,
        ),
        "cuLaunchKernel(kd_plan_stale_schedule)",
    )
