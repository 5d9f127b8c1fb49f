"""The CUDA driver entry points of the flight recorder's per-call path, called through ctypes on
libcuda itself.

cuda-bindings wraps every handle in an object and returns a result enum per call: on the H200
host a recorded eager call spent about a third of its added host time in nine such calls. Here a
call is one ctypes foreign call on plain integers (stream, event and function handles as their
addresses), its result an int checked against 0. libcuda is already loaded by torch; without it
(`available()` False) callers keep the cuda-bindings path. No compiled code of kdump's own.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from kdump.cuda.nvrtc import LaunchError

_u = ctypes.c_uint
_p = ctypes.c_void_p
_sz = ctypes.c_size_t
_u64 = ctypes.c_uint64

# name -> (symbol in libcuda, argument types); every one returns a CUresult (int)
_SIGNATURES: dict[str, tuple[str, list[Any]]] = {
    "launch": ("cuLaunchKernel", [_p, _u, _u, _u, _u, _u, _u, _u, _p, _p, _p]),
    "d2h": ("cuMemcpyDtoHAsync_v2", [_p, _u64, _sz, _p]),
    "d2d": ("cuMemcpyDtoDAsync_v2", [_u64, _u64, _sz, _p]),
    "record": ("cuEventRecord", [_p, _p]),
    "wait": ("cuStreamWaitEvent", [_p, _p, _u]),
}

# Entry points the recorder can do without (a driver that lacks one keeps every other ctypes
# call; the caller falls back where it is None): stream writes need a CUDA 11.7 driver.
_OPTIONAL: dict[str, tuple[str, list[Any]]] = {
    "copy2d": ("cuMemcpy2DAsync_v2", [_p, _p]),
    "write64": ("cuStreamWriteValue64_v2", [_p, _u64, _u64, _u]),
}
# What a driver that cannot do a call answers (nothing was enqueued): CUDA_ERROR_INVALID_VALUE,
# CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_SUPPORTED. Any other error (a sticky one left by a
# kernel, above all) is not the call's.
REFUSED = frozenset({1, 500, 801})

MEMORYTYPE_HOST, MEMORYTYPE_DEVICE = 1, 2  # CUmemorytype


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (cuda.h): a copy of `Height` rows of `WidthInBytes` bytes, each side's rows
    a pitch apart."""

    _fields_ = [
        ("srcXInBytes", _sz),
        ("srcY", _sz),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", _p),
        ("srcDevice", _u64),
        ("srcArray", _p),
        ("srcPitch", _sz),
        ("dstXInBytes", _sz),
        ("dstY", _sz),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", _p),
        ("dstDevice", _u64),
        ("dstArray", _p),
        ("dstPitch", _sz),
        ("WidthInBytes", _sz),
        ("Height", _sz),
    ]


assert ctypes.sizeof(Memcpy2D) == 128, "CUDA_MEMCPY2D layout"

_lock = threading.Lock()
_fns: dict[str, Any] | None = None
_failed = False


def _load() -> dict[str, Any] | None:
    global _fns, _failed
    with _lock:
        if _fns is not None or _failed:
            return _fns
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fns = {}
            for name, (symbol, argtypes) in _SIGNATURES.items():
                f = getattr(lib, symbol)
                f.argtypes, f.restype = argtypes, ctypes.c_int
                fns[name] = f
            for name, (symbol, argtypes) in _OPTIONAL.items():
                f = getattr(lib, symbol, None)
                if f is not None:
                    f.argtypes, f.restype = argtypes, ctypes.c_int
                fns[name] = f
            err = lib.cuGetErrorName
            err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            err.restype = ctypes.c_int
            fns["error_name"] = err
        except (OSError, AttributeError):
            _failed = True
            return None
        _fns = fns
        return fns


def available() -> bool:
    """Whether libcuda's entry points are callable here."""
    return _load() is not None


class DriverError(LaunchError):
    """A driver call of the recorder failed with CUresult `code`."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code

    @property
    def refused(self) -> bool:
        """The driver cannot make this call (nothing was enqueued), as opposed to an error of
        the context (`REFUSED`)."""
        return self.code in REFUSED


def _raise(code: int, what: str) -> None:
    fns = _load()
    name = ctypes.c_char_p()
    if fns is not None and fns["error_name"](code, ctypes.byref(name)) == 0 and name.value:
        raise DriverError(f"{what} failed: {name.value.decode()}", code)
    raise DriverError(f"{what} failed: CUDA error {code}", code)


def handle(h: Any) -> int:
    """The address of a driver handle: an int, or a cuda-bindings object (CUstream, CUevent,
    CUfunction)."""
    return h if isinstance(h, int) else int(h)


class Driver:
    """Bound entry points (`_load` must have succeeded); each method raises LaunchError on a
    failed call."""

    def __init__(self) -> None:
        fns = _load()
        if fns is None:
            raise LaunchError("libcuda.so.1 is not loadable")
        self._launch = fns["launch"]
        self._d2h = fns["d2h"]
        self._d2d = fns["d2d"]
        self._record = fns["record"]
        self._wait = fns["wait"]
        self._copy2d = fns["copy2d"]
        self._write64 = fns["write64"]
        # one descriptor per process, filled per call: every caller holds the recorder's lock
        # (the driver has read it when cuMemcpy2DAsync returns)
        self._rows = Memcpy2D(srcMemoryType=MEMORYTYPE_DEVICE, dstMemoryType=MEMORYTYPE_HOST)
        self._rows_at = ctypes.addressof(self._rows)

    def launch(
        self, fn: int, grid: int, threads: int, args: Any, stream: int, what: str, smem: int = 0
    ) -> None:
        """cuLaunchKernel of a 1-D grid; `args` the kernel's void* array (a ctypes array), `smem`
        its dynamic shared memory bytes."""
        r = self._launch(fn, grid, 1, 1, threads, 1, 1, smem, stream, args, None)
        if r:
            _raise(r, f"cuLaunchKernel({what})")

    def d2h(self, dst: int, src: int, n: int, stream: int) -> None:
        r = self._d2h(dst, src, n, stream)
        if r:
            _raise(r, "cuMemcpyDtoHAsync")

    def d2h_rows(self, dst: int, src: int, pitch: int, n: int, rows: int, stream: int) -> None:
        """`rows` copies of `n` bytes from device address `src` to host address `dst`, row k at
        `k * pitch` on both sides, as one driver call (cuMemcpy2DAsync)."""
        if self._copy2d is None:
            raise DriverError("cuMemcpy2DAsync_v2 is not in this driver", 500)
        d = self._rows
        d.srcDevice, d.srcPitch, d.dstHost, d.dstPitch = src, pitch, dst, pitch
        d.WidthInBytes, d.Height = n, rows
        r = self._copy2d(self._rows_at, stream)
        if r:
            _raise(r, "cuMemcpy2DAsync")

    def write64(self, stream: int, dst: int, value: int) -> None:
        """Write the u64 `value` to device address `dst` (a mapped host address: its device
        pointer) once the stream's earlier work is done, behind a memory fence
        (cuStreamWriteValue64, no kernel)."""
        if self._write64 is None:
            raise DriverError("cuStreamWriteValue64_v2 is not in this driver", 500)
        r = self._write64(stream, dst, value, 0)
        if r:
            _raise(r, "cuStreamWriteValue64")

    def d2d(self, dst: int, src: int, n: int, stream: int) -> None:
        r = self._d2d(dst, src, n, stream)
        if r:
            _raise(r, "cuMemcpyDtoDAsync")

    def record(self, event: int, stream: int) -> None:
        r = self._record(event, stream)
        if r:
            _raise(r, "cuEventRecord")

    def wait(self, stream: int, event: int) -> None:
        r = self._wait(stream, event, 0)
        if r:
            _raise(r, "cuStreamWaitEvent")


_driver: Driver | None = None


def driver() -> Driver | None:
    """The bound entry points, or None where libcuda cannot be loaded."""
    global _driver
    if _driver is None and available():
        _driver = Driver()
    return _driver
