"""The CUDA toolchain of kdump's own kernels (the packaged GEMM, the flight recorder's snapshot
kernel): cuda-bindings' driver API, NVRTC's version against the driver's. Shared here so that
the recorder needs nothing from a kernel library's package."""

from __future__ import annotations

from typing import Any

from kdump.errors import CannotRunError


class ToolchainError(CannotRunError):
    """kdump's own kernels cannot be built or launched here (NVRTC, headers or driver missing or
    too old); the message says what to do."""


class LaunchError(RuntimeError):
    """A CUDA driver call of one of kdump's kernels failed (a kernel error, e.g. an illegal
    address left sticky by an earlier launch), not a missing prerequisite."""


_DRIVER: Any = None  # cuda.bindings.driver once imported (asked for on every recorded call)


def driver() -> Any:
    """cuda.bindings.driver (ToolchainError without cuda-bindings)."""
    global _DRIVER
    if _DRIVER is None:
        try:
            from cuda.bindings import driver as drv
        except ImportError as exc:
            raise ToolchainError(f"cuda-bindings is not installed ({exc})") from exc
        _DRIVER = drv
    return _DRIVER


def check(result: Any, what: str) -> Any:
    """cuda.bindings returns (CUresult, *values); raise LaunchError on error, return the values."""
    drv = _DRIVER if _DRIVER is not None else driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise LaunchError(f"{what} failed: {name.decode() if name else err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def nvrtc_version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise ToolchainError(f"cuda-bindings is not installed ({exc})") from exc
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the shared library itself can be missing
        raise ToolchainError(
            f"NVRTC is not loadable ({exc}): pip install nvidia-cuda-nvrtc"
        ) from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def driver_version() -> tuple[int, int] | None:
    """CUDA version the installed driver supports, e.g. (13, 0); None without a driver."""
    try:
        from cuda.bindings import driver as drv

        err, ver = drv.cuDriverGetVersion()
    except Exception:
        return None
    if err != drv.CUresult.CUDA_SUCCESS:
        return None
    return int(ver) // 1000, (int(ver) % 1000) // 10


def check_nvrtc_vs_driver() -> None:
    """A cubin from a newer NVRTC than the driver supports fails to load with an obscure error;
    refuse early with a clear one."""
    drv = driver_version()
    if drv is None:
        return  # compiling without a GPU (CI) is fine
    rtc = nvrtc_version()
    if rtc > drv:
        raise ToolchainError(
            f"NVRTC {rtc[0]}.{rtc[1]} is newer than the driver's CUDA {drv[0]}.{drv[1]}: install "
            f"nvidia-cuda-nvrtc=={drv[0]}.{drv[1]}.* or upgrade the NVIDIA driver"
        )
