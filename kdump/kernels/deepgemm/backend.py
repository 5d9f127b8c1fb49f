"""The "deep_gemm" backend: the installed DeepGEMM, imported from any module that binds it.

It runs what the bundle recorded, as recorded: arguments bind to the installed build by
position and keyword as the recorded program passed them. A call the spec refuses (a callable
or unrebuildable epilogue, a mega-MoE kernel's raw pointers) is refused here too, in one line,
before anything runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from kdump.errors import CannotRunError
from kdump.kernels.deepgemm.binding import Binder
from kdump.kernels.deepgemm.names import DEEPGEMM_MODULES, aliases_of
from kdump.kernels.deepgemm.signature import positional_names
from kdump.kernels.plugin import Backend, KernelSpec


def _function_name(spec: KernelSpec) -> str:
    return spec.id.partition(":")[2]


def _is_deepgemm(spec: KernelSpec) -> bool:
    return spec.library() == "deep_gemm"


def import_deep_gemm() -> Any:
    errors = []
    for mod in DEEPGEMM_MODULES:
        try:
            return importlib.import_module(mod)
        except ImportError as exc:
            errors.append(f"{mod}: {exc}")
        except Exception as exc:  # a broken build (torch ABI mismatch) raises other errors
            errors.append(f"{mod}: {type(exc).__name__}: {exc}")
    raise CannotRunError(
        "DeepGEMM is not importable here (" + "; ".join(errors)[:300] + "); install the build "
        "the bundle was recorded with, or use --backend packaged / reference"
    )


class DeepGemmBackend(Backend):
    """The installed DeepGEMM, resolved by the canonical name or any alias it exports."""

    name = "deep_gemm"

    def available(self, spec: KernelSpec, device: torch.device) -> tuple[bool, str]:
        if not _is_deepgemm(spec):
            return False, f"{spec.id} is not a DeepGEMM entry point"
        if device.type != "cuda":
            return False, "DeepGEMM needs a CUDA GPU"
        try:
            self._function(spec)
        except CannotRunError as exc:
            return False, str(exc)
        return True, ""

    def _function(self, spec: KernelSpec) -> Callable[..., Any]:
        module = import_deep_gemm()
        name = _function_name(spec)
        for cand in (name, *aliases_of(name)):
            fn = getattr(module, cand, None)
            if fn is not None:
                return fn
        raise CannotRunError(
            f"the installed DeepGEMM ({getattr(module, '__version__', '?')}) has no {name} or any "
            "of its aliases; use --backend packaged or reference"
        )

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        fn = self._function(spec)

        def run(*args: Any, **kwargs: Any) -> Any:
            why = spec.refusal(spec.bind(args, kwargs))
            if why:
                raise CannotRunError(why)
            _same_order(spec, fn, len(args))
            return fn(*args, **kwargs)

        return run

    def version(self) -> str | None:
        try:
            mod = import_deep_gemm()
        except CannotRunError:
            return None
        return str(getattr(mod, "__version__", "unknown"))


def _same_order(spec: KernelSpec, fn: Any, n_args: int) -> None:
    """Refuse (cannot run) a call whose positional arguments would land elsewhere in the
    installed build than in the build that recorded them (sgl-deep-gemm's k-grouped tail against
    upstream's): the recorded values are passed as they were, by position."""
    recorded = getattr(spec, "positional_names", lambda: None)()
    live = positional_names(fn)
    params = getattr(spec, "params", None)
    if not recorded or not live or params is None:
        return
    was = Binder(spec.id, params, recorded).slots[:n_args]
    now = Binder(spec.id, params, live).slots[:n_args]
    for i, (a, b) in enumerate(zip(was, now)):
        if a != b:
            raise CannotRunError(
                f"{spec.id}: the installed DeepGEMM orders its arguments differently from the "
                f"build that recorded the call (argument {i}: {a} there, {b} here); replay with "
                "the recorded build, or with --backend reference"
            )
