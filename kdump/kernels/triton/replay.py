"""Replaying a recorded Triton launch: the installed kernel, launched again as recorded.

A bundle names the kernel (its target, 'module:qualname') and keeps the launch (grid, launch
options, the source's SHA-256, the Triton version); the kernel's code is always the one installed
where the replay runs, resolved under the replay's trust rule. What the recording had is compared
with what runs: a changed source or another Triton version is said in one line, and the replay
goes on (its outputs against the recorded ones say whether the change matters).

A kernel runs compiled on a GPU, or in Triton's interpreter (TRITON_INTERPRET=1: numpy on the CPU)
where there is none; which one a module's `@triton.jit` made is fixed when the module is imported,
so the interpreter has to be asked for before the kernel's module is imported (`want_interpreter`).
Nothing here imports triton: objects are recognised by kdump.kernels.triton.launch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kdump.errors import CannotRunError
from kdump.format.records import LaunchRecord
from kdump.kernels.triton import launch as tl_launch

INTERPRET_VAR = "TRITON_INTERPRET"  # Triton's own switch, read when `@triton.jit` runs


def is_triton_launch(launch: LaunchRecord | None) -> bool:
    return launch is not None and launch.kind == tl_launch.KIND


def is_interpreted(kernel: Any) -> bool:
    """Whether the kernel launches through Triton's interpreter (an InterpretedFunction)."""
    return type(tl_launch.innermost(kernel)).__name__ == "InterpretedFunction"


def want_interpreter() -> None:
    """Make `@triton.jit` give interpreted kernels in this process from now on (the modules
    imported afterwards). Triton reads the variable on every decoration and interpreted launch,
    so it stays set for the rest of the process."""
    os.environ[INTERPRET_VAR] = "1"


def _short(sha: str) -> str:
    return f"{sha[:4]}…" if sha else "none"


def kernel_for(target: str, obj: Any, device_type: str | None = None) -> Any:
    """`obj` (what the target resolved to) as a Triton kernel that can run on `device_type`
    (None: anywhere); CannotRunError, in one line, otherwise."""
    from kdump.text import visible

    shown = visible(target, 200)
    if not tl_launch.is_kernel(obj):
        kind = type(obj).__name__
        owner = getattr(type(obj), "__module__", "")
        raise CannotRunError(
            f"the bundle recorded a Triton launch of {shown}, but the installed {shown} is a "
            f"{kind}{f' of {owner}' if owner else ''}, not a Triton kernel (@triton.jit); replay "
            "it where the kernel's module defines it as one"
        )
    interpreted = is_interpreted(obj)
    if device_type == "cpu" and not interpreted:
        raise CannotRunError(
            f"{shown} was imported compiled in this process, and a Triton kernel runs on the "
            "CPU only in Triton's interpreter; replay it in a process of its own (the default) "
            "or on a GPU"
        )
    if device_type == "cuda" and interpreted:
        raise CannotRunError(
            f"{shown} was imported under TRITON_INTERPRET=1 in this process; unset it to replay "
            "the compiled kernel on the GPU"
        )
    return obj


def installed_version() -> str:
    return tl_launch.triton_version()


def differences(kernel: Any, launch: LaunchRecord) -> list[str]:
    """One line per way the installed kernel differs from the recorded one (source, Triton
    version); empty when it is the same."""
    out: list[str] = []
    here = tl_launch.source_sha256(tl_launch.innermost(kernel))
    if here != launch.source_sha256:
        out.append(
            f"kernel source changed since the recording (sha256 {_short(launch.source_sha256)} "
            f"recorded, {_short(here)} installed)"
        )
    version = installed_version()
    if launch.version and version != launch.version:
        out.append(f"Triton version differs: recorded {launch.version}, installed {version}")
    return out


def runner(kernel: Any, launch: LaunchRecord) -> Callable[..., None]:
    """The callable a replay runs with the recorded (args, kwargs): the kernel launched with the
    recorded grid and launch options. A launch returns a handle (the compiled kernel), not a
    result: the runner returns None."""

    jit = tl_launch.innermost(kernel)
    clash = sorted(set(launch.options) & {*tl_launch.param_names(jit), "grid", "warmup"})
    if clash:
        raise CannotRunError(
            f"the bundle's launch options name {', '.join(map(repr, clash[:3]))[:200]}, which "
            "the installed kernel takes as its own parameters (or Triton as the launch's): the "
            "launch record does not fit this kernel"
        )

    def run(*args: Any, **kwargs: Any) -> None:
        try:
            tl_launch.launch_again(kernel, launch, args, kwargs)
        except KeyError as exc:
            # Triton's own check of the keywords of a compiled launch: an option the recording's
            # Triton had and this one does not is no fault of the kernel
            said = str(exc.args[0]) if exc.args else ""
            if "specified but unrecognised" not in said:
                raise
            raise CannotRunError(
                f"the installed Triton {installed_version()} rejects a recorded launch option "
                f"({said[:200]}; recorded with Triton {launch.version[:40]}); replay with the "
                "Triton the recording used"
            ) from None

    run.__name__ = getattr(tl_launch.innermost(kernel), "__name__", "triton_kernel")
    return run


def launch_key(launch: LaunchRecord) -> dict[str, Any]:
    """The launch as plain JSON values (a cache key's part)."""
    return {
        "kind": launch.kind,
        "grid": list(launch.grid),
        "options": dict(sorted(launch.options.items())),
        "constexprs": list(launch.constexprs),
        "source_sha256": launch.source_sha256,
        "version": launch.version,
    }
