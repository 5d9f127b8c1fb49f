"""What kdump knows of a Triton kernel object and of one launch of it (no torch, no triton import).

`@triton.jit` gives a `JITFunction` (an `InterpretedFunction` under TRITON_INTERPRET=1);
`@triton.autotune` and `@triton.heuristics` wrap one in an `Autotuner` / `Heuristics` whose `fn`
is the next object inward. Every launch, however it is written (`kernel[grid](...)`,
`kernel.run(...)`, an autotuner's chosen config, a heuristics wrapper's added values), ends in
the innermost object's `run(*args, grid=..., warmup=..., **kwargs)` with the kernel's own
arguments, its constexprs and the launch options as keywords: that call is what kdump records,
and what a replay makes again (`launch_again`).

Objects are recognised by what they are (their class comes from the `triton` package and has
`run`), never by importing Triton: the recorder runs inside the recorded program, and a bundle
never makes kdump import anything.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kdump.format.records import MAX_GRID, LaunchRecord

KIND = "triton"
_DEF = re.compile(r"^def\s+\w+\s*\(", re.MULTILINE)


def is_kernel(obj: Any) -> bool:
    """A Triton kernel object: a JITFunction, InterpretedFunction, Autotuner or Heuristics."""
    cls = type(obj)
    return (
        getattr(cls, "__module__", "").split(".")[0] == "triton"
        and callable(getattr(obj, "run", None))
        and hasattr(cls, "__getitem__")
    )


def chain(obj: Any) -> list[Any]:
    """`obj` and the kernel objects it wraps, outermost first (an autotuner, its heuristics, the
    JITFunction). A wrapper's `fn` is the next one inward; the last is the one that launches."""
    out = [obj]
    while len(out) < 16:
        inner = getattr(out[-1], "fn", None)
        if inner is None or not is_kernel(inner):
            break
        out.append(inner)
    return out


def innermost(obj: Any) -> Any:
    return chain(obj)[-1]


def python_function(jit: Any) -> Callable[..., Any] | None:
    fn = getattr(jit, "fn", None)
    return fn if inspect.isfunction(fn) else None


def source_text(jit: Any) -> str | None:
    """The kernel function's source as Triton normalises it (dedented, decorators cut: it starts
    at `def`), the same for a JITFunction and an InterpretedFunction of one function."""
    fn = python_function(jit)
    text: str | None = None
    if fn is not None:
        try:
            text = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError):
            text = None
    if text is None:
        src = getattr(jit, "src", None)
        text = src if isinstance(src, str) else None
    if text is None:
        return None
    m = _DEF.search(text)
    return text[m.start() :] if m else text


def source_sha256(jit: Any) -> str:
    """SHA-256 of `source_text`; of the function's qualified name where no source is found (a
    kernel defined in an interactive session), so that it still compares."""
    text = source_text(jit)
    if text is None:
        fn = python_function(jit)
        text = f"<no source> {getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _signature(jit: Any) -> inspect.Signature | None:
    sig = getattr(jit, "signature", None)
    if isinstance(sig, inspect.Signature):
        return sig
    fn = python_function(jit)
    try:
        return inspect.signature(fn) if fn is not None else None
    except (TypeError, ValueError):
        return None


def param_names(jit: Any) -> tuple[str, ...]:
    names = getattr(jit, "arg_names", None)
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        return tuple(names)
    sig = _signature(jit)
    return tuple(sig.parameters) if sig is not None else ()


def _annotation_text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty or annotation is None:
        return ""
    if isinstance(annotation, str):
        return annotation
    return f"{getattr(annotation, '__module__', '')}.{getattr(annotation, '__qualname__', '')}"


def constexpr_names(jit: Any) -> tuple[str, ...]:
    """The parameters annotated `tl.constexpr` (compile-time constants)."""
    params = getattr(jit, "params", None)
    if isinstance(params, list) and params and hasattr(params[0], "is_constexpr"):
        return tuple(p.name for p in params if p.is_constexpr)
    sig = _signature(jit)
    if sig is None:
        return ()
    return tuple(
        name for name, p in sig.parameters.items() if "constexpr" in _annotation_text(p.annotation)
    )


def split_options(jit: Any, kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the kernel's keyword arguments, the launch options): a keyword that names no parameter
    of the kernel is a launch option (num_warps, num_stages, num_ctas, maxnreg, ...)."""
    names = set(param_names(jit))
    own = {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}
    return own, options


def bound_arguments(jit: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter's value for this launch, defaults included, plus the launch options: the
    `META` dictionary Triton hands a grid function."""
    own, options = split_options(jit, kwargs)
    sig = _signature(jit)
    meta: dict[str, Any] = {}
    if sig is not None:
        try:
            bound = sig.bind_partial(*args, **own)
            bound.apply_defaults()
            meta.update(bound.arguments)
        except TypeError:
            meta.update(zip(param_names(jit), args))
            meta.update(own)
    else:
        meta.update(zip(param_names(jit), args))
        meta.update(own)
    meta.update(options)
    return meta


def evaluate_grid(
    grid: Any, jit: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[int, ...]:
    """The grid of this launch as integers: a grid function is called with the launch's META
    (once; the launch then gets the numbers, so a grid function runs once per launch, as it does
    unrecorded). Raises ValueError for a grid that is not 1 to 3 integers."""
    if callable(grid):
        grid = grid(bound_arguments(jit, args, kwargs))
    if not isinstance(grid, (tuple, list)):
        grid = (grid,)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"a grid of {len(grid)} dimensions")
    out = []
    for g in grid:
        value = int(g)  # numpy and torch integers, constexpr wrappers with __index__
        if not 0 <= value <= MAX_GRID:
            raise ValueError(f"grid dimension {value} outside [0, {MAX_GRID}]")
        out.append(value)
    return tuple(out)


def json_option(value: Any) -> Any:
    """A launch option as the format keeps it (null, bool, int, str): enum-like values by name,
    anything else by its text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "__index__"):
        return int(value)
    return str(value)


def triton_version() -> str:
    import sys

    mod = sys.modules.get("triton")
    return str(getattr(mod, "__version__", "unknown"))


def launch_record(jit: Any, grid: tuple[int, ...], options: Mapping[str, Any]) -> LaunchRecord:
    return LaunchRecord(
        kind=KIND,
        grid=tuple(grid),
        options={str(k): json_option(v) for k, v in options.items()},
        constexprs=constexpr_names(jit),
        source_sha256=source_sha256(jit),
        version=triton_version(),
    )


def launch_again(
    kernel: Any, launch: LaunchRecord, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """Launch `kernel` (any object of its chain: the innermost one launches, so an autotuner
    does not tune again) as recorded: the recorded grid, arguments and launch options."""
    jit = innermost(kernel)
    return jit.run(*args, grid=tuple(launch.grid), warmup=False, **kwargs, **launch.options)
