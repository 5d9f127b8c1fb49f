"""Hooking a Triton kernel at its launch (`-t mymod:my_kernel` where `my_kernel` is a
`@triton.jit` function, autotuned or with heuristics).

A Triton kernel object cannot be replaced by a function wrapper: the program subscripts it
(`my_kernel[grid](...)`), calls `.run(...)`, and autotuners and heuristics hold the inner object
in their `fn`. Every launch however ends in the innermost object's `run(*args, grid=...,
warmup=..., **kwargs)` (kdump.kernels.triton.launch), looked up on the instance: so kdump sets an
instance attribute `run` there, which records the launch and calls the class's bound `run`.
Unpatching deletes the attribute (only while it is still ours).

What passes through unrecorded and uncounted: `warmup=True` calls (compilation only), the
launches an autotuner makes while benchmarking its configs (its `_bench` is wrapped on the
instance to say so; a Triton without `_bench` skips that refinement) and launches nested in
another recorded call.

The handler of the recording session gets a `Launch` as the call's `fn`: calling it runs the
launch as the program asked (with the grid evaluated once here, so a grid function runs once
per launch), and it carries the launch record and the notes a recorder writes into the call.
This module imports neither torch nor triton: the recorder runs inside the recorded program.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kdump.format.argtree import Pointer
from kdump.format.records import LaunchRecord
from kdump.kernels.triton import launch as tl_launch
from kdump.log import log_once

POINTER_NOTE = (
    "opaque-pointer: {names} held a raw address passed as an integer (or an object with "
    "data_ptr() that is no tensor); it is recorded as $pointer, the memory behind it is not, "
    "and a replay refuses this call"
)


_ABSENT = object()


class _Benchmarking(threading.local):
    flag = False  # an autotuner benchmarks its configs on this thread


benchmarking = _Benchmarking()


class Launch:
    """The `fn` a recording handler gets for one Triton launch: `fn(*args, **kwargs)` launches
    it as the program asked (`Pointer`s the recorder was handed are given back as the values
    the program passed). `kdump_launch`: the launch record; `kdump_notes`: lines for the call's
    meta."""

    __slots__ = ("_real", "grid", "kdump_launch", "kdump_notes", "options", "run")

    def __init__(
        self,
        run: Callable[..., Any],
        grid: tuple[int, ...],
        options: dict[str, Any],
        record: LaunchRecord,
        notes: list[str],
        real: dict[int, Any],
    ) -> None:
        self.run = run
        self.grid = grid
        self.options = options
        self.kdump_launch = record
        self.kdump_notes = notes
        self._real = real

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._real:
            real = self._real
            args = tuple(real.get(id(a), a) for a in args)
            kwargs = {k: real.get(id(v), v) for k, v in kwargs.items()}
        return self.run(*args, grid=self.grid, warmup=False, **kwargs, **self.options)


def launch_of(fn: Any) -> tuple[LaunchRecord | None, list[str]]:
    """(the launch record, the notes) of a handler's `fn`: (None, []) for any other call."""
    if type(fn) is Launch:
        return fn.kdump_launch, fn.kdump_notes
    return None, []


def launch_key(record: LaunchRecord | None) -> Any:
    """A hashable key of a launch record (the exact-repeat paths key calls by it as well)."""
    if record is None:
        return None
    return (record.grid, tuple(sorted(record.options.items())), record.source_sha256)


# ---------------------------------------------------------------------------------------------
# Installing the hook


def install(
    st: Any, called_as: str, kernel: Any, busy: Any
) -> list[tuple[Any, str, Callable[..., Any]]]:
    """Hook `kernel`'s launches for the hook state `st` (kdump.record.hooks.HookState: its
    handler, counter, trigger, `armed`); `busy` is the hooks' thread-local nesting guard.
    Returns (object, attribute, what we set) for each instance attribute set, for unpatching.
    Raises when the innermost object's `run` cannot be set (the caller logs it)."""
    jit = tl_launch.innermost(kernel)
    original = jit.run  # the class's method, bound
    made: list[tuple[Any, str, Callable[..., Any]]] = []
    hook = _run_hook(st, called_as, jit, original, busy)
    jit.run = hook
    made.append((jit, "run", hook))
    return made + bench_hooks(kernel)


def bench_hooks(kernel: Any) -> list[tuple[Any, str, Callable[..., Any]]]:
    """Mark the benchmark launches of each autotuner in `kernel`'s chain (its `_bench` wrapped
    on the instance); also for a kernel whose innermost launch is hooked already through
    another wrapper of it (two autotuners over one JITFunction). Returns what `install` does."""
    made: list[tuple[Any, str, Callable[..., Any]]] = []
    for obj in tl_launch.chain(kernel)[:-1]:
        bench = obj.__dict__.get("_bench") if hasattr(obj, "__dict__") else None
        real_bench = getattr(obj, "_bench", None)
        if bench is not None or not callable(real_bench):
            continue  # ours already (another target over the same autotuner), or none
        wrapped = _bench_hook(real_bench)
        try:
            obj._bench = wrapped
        except Exception:
            continue  # a Triton whose autotuner refuses attributes: its bench launches record
        made.append((obj, "_bench", wrapped))
    return made


def _bench_hook(real: Callable[..., Any]) -> Callable[..., Any]:
    def kdump_bench(*args: Any, **kwargs: Any) -> Any:
        prev = benchmarking.flag
        benchmarking.flag = True
        try:
            return real(*args, **kwargs)
        finally:
            benchmarking.flag = prev

    kdump_bench.__kdump_bench__ = True  # type: ignore[attr-defined]
    return kdump_bench


def _run_hook(
    st: Any, called_as: str, jit: Any, original: Callable[..., Any], busy: Any
) -> Callable[..., Any]:
    def kdump_run(*args: Any, **kwargs: Any) -> Any:
        # exactly what the program passed goes to the original where nothing is recorded (a
        # call without grid= fails there as it would unhooked)
        grid = kwargs.get("grid", _ABSENT)
        if (
            grid is _ABSENT
            or kwargs.get("warmup")
            or not st.armed
            or busy.flag
            or benchmarking.flag
        ):
            return original(*args, **kwargs)
        i = next(st.counter)
        if not st.consider(i):
            return original(*args, **kwargs)
        try:
            rest = {k: v for k, v in kwargs.items() if k != "grid" and k != "warmup"}
            fn, args2, own = prepare(jit, original, grid, args, rest)
        except Exception as exc:  # recording never breaks the program: launch unrecorded
            log_once(
                f"launch:{st.id}",
                f"cannot record a launch of {called_as} ({type(exc).__name__}: {exc}); it runs "
                "unrecorded",
            )
            return original(*args, **kwargs)
        busy.flag = True  # launches made inside this one pass through unrecorded
        try:
            return st.handler(st, i, called_as, fn, args2, own)
        finally:
            busy.flag = False

    kdump_run.__kdump_state__ = st  # type: ignore[attr-defined]
    return kdump_run


def prepare(
    jit: Any, original: Callable[..., Any], grid: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Launch, tuple[Any, ...], dict[str, Any]]:
    """(the `Launch`, the positional arguments and the kernel's keywords a recorder records):
    the launch options split off, the grid evaluated once, raw pointers marked."""
    own, options = tl_launch.split_options(jit, kwargs)
    evaluated = tl_launch.evaluate_grid(grid, jit, args, kwargs)
    record = tl_launch.launch_record(jit, evaluated, options)
    args2, own2, marked, real = mark_pointers(jit, tuple(args), own)
    notes = [POINTER_NOTE.format(names=", ".join(marked))] if marked else []
    return Launch(original, evaluated, options, record, notes, real), args2, own2


# ---------------------------------------------------------------------------------------------
# Raw pointers passed as integers

_TENSOR_TYPES: tuple[type, ...] = ()


def mark_pointers(
    jit: Any, args: tuple[Any, ...], own: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], list[str], dict[int, Any]]:
    """The arguments with each raw pointer wrapped in `Pointer`: an integer of a parameter that
    is no constexpr whose value is an address inside a tensor argument of this launch or a CUDA
    device allocation, and an object with `data_ptr()` that is no tensor (Triton launches it
    as a pointer; kdump cannot know what it points at). Returns (args, keywords, the marked
    parameters' names, id of each Pointer -> the value it stands for)."""
    names = tl_launch.param_names(jit)
    consts = set(tl_launch.constexpr_names(jit))
    spans = _tensor_spans([*args, *own.values()])
    marked: list[str] = []
    real: dict[int, Any] = {}

    def check(name: str, v: Any) -> Any:
        if name in consts:
            return v
        addr = _pointer_value(v, spans)
        if addr is None:
            return v
        p = Pointer(addr)
        real[id(p)] = v
        marked.append(name)
        return p

    out_args = tuple(check(names[k] if k < len(names) else f"#{k}", v) for k, v in enumerate(args))
    out_own = {k: check(k, v) for k, v in own.items()}
    return out_args, out_own, marked, real


def _tensor_spans(values: list[Any]) -> list[tuple[int, int]]:
    """[start, end) of the storage behind each tensor argument."""
    global _TENSOR_TYPES
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    if not _TENSOR_TYPES:
        _TENSOR_TYPES = (torch.Tensor,)
    spans = []
    for v in values:
        if isinstance(v, _TENSOR_TYPES):
            try:
                st = v.untyped_storage()
                spans.append((int(st.data_ptr()), int(st.data_ptr()) + int(st.nbytes())))
            except Exception:
                continue
    return spans


MIN_ADDRESS = 1 << 16  # smaller integers are sizes, strides and flags, never addresses
# CUDA's allocations lie above 4 GiB of the address space on 64-bit hosts: the driver is asked
# only about integers that could be one (not about every element count of a launch)
MIN_DEVICE_ADDRESS = 1 << 32


def _pointer_value(v: Any, spans: list[tuple[int, int]]) -> int | None:
    tp = type(v)
    if tp is int:
        if v < MIN_ADDRESS or v >= 1 << 64:
            return None
        if any(lo <= v < hi for lo, hi in spans):
            return v
        return v if v >= MIN_DEVICE_ADDRESS and is_device_address(v) else None
    if tp is bool or tp is float or tp is str or v is None:
        return None
    if _TENSOR_TYPES and isinstance(v, _TENSOR_TYPES):
        return None
    data_ptr = getattr(v, "data_ptr", None)
    if callable(data_ptr) and not isinstance(v, type):
        try:
            addr = int(data_ptr())
        except Exception:
            return None
        return addr if 0 <= addr < 1 << 64 else None
    return None


_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_MEMORYTYPE_DEVICE = 2
_driver: Any = None
_driver_failed = False


def is_device_address(v: int) -> bool:
    """Whether `v` is an address in CUDA device memory, asked of the driver
    (cuPointerGetAttribute: a query, allowed during stream capture) only where CUDA is in use
    already; never initialises CUDA."""
    global _driver, _driver_failed
    torch = sys.modules.get("torch")
    if torch is None or _driver_failed:
        return False
    try:
        if not torch.cuda.is_initialized():
            return False
        if _driver is None:
            fn = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            fn.restype = ctypes.c_int
            _driver = fn
        kind = ctypes.c_uint(0)
        rc = _driver(ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, v)
        return rc == 0 and kind.value == _CU_MEMORYTYPE_DEVICE
    except Exception:
        _driver_failed = True
        return False


def module_kernels(module: Any) -> list[str]:
    """The names of the Triton kernels `module` defines (globals that are kernel objects whose
    innermost function's `__module__` is the module), outermost only: a JITFunction that an
    autotuner of the same module wraps is hooked through that autotuner's name."""
    name = getattr(module, "__name__", None)
    try:
        items = list(vars(module).items())
    except TypeError:
        return []
    kernels = [
        (k, v)
        for k, v in items
        if isinstance(k, str) and tl_launch.is_kernel(v) and _defined_by(v, name)
    ]
    inner = {id(x) for _, v in kernels for x in tl_launch.chain(v)[1:]}
    return [k for k, v in kernels if id(v) not in inner]


def _defined_by(kernel: Any, module: str | None) -> bool:
    fn = tl_launch.python_function(tl_launch.innermost(kernel))
    return fn is not None and getattr(fn, "__module__", None) == module
