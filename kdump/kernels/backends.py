"""Backends that run a recorded call: the installed library, kdump's packaged kernel, the torch
reference, or the recorded target itself (generic targets)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from kdump.errors import CannotRunError, UsageError
from kdump.kernels.deepgemm.names import DEEPGEMM_ENTRY_POINTS, DEEPGEMM_MODULES
from kdump.kernels.plugin import Backend, KernelSpec

BACKEND_NAMES = ("auto", "reference", "deep_gemm", "packaged", "library", "packaged-faulty")


def _function_name(spec: KernelSpec) -> str:
    return spec.id.partition(":")[2]


def _is_deepgemm(spec: KernelSpec) -> bool:
    return spec.id.startswith("deep_gemm:")


class ReferenceBackend(Backend):
    """The spec's torch reference, written into the outputs' meaningful elements only (elements
    the kernel does not promise to write are left untouched, as on SM120)."""

    name = "reference"

    def available(self, spec: KernelSpec, device: torch.device) -> tuple[bool, str]:
        if not spec.has_reference():
            return False, f"{spec.id} has no torch reference; use --backend library"
        return True, ""

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> None:
            bound = spec.bind(args, kwargs)
            expected = spec.reference(bound)
            for name, value in expected.items():
                out = bound[name]
                mask = spec.meaningful(bound, name)
                value = value.to(out.device, out.dtype)
                if mask is None:
                    out.copy_(value)
                else:
                    out.copy_(torch.where(mask.to(out.device).expand(out.shape), value, out))

        return run

    def version(self) -> str | None:
        return f"torch {torch.__version__}"


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
        for cand in (name, *DEEPGEMM_ENTRY_POINTS.get(name, ())):
            fn = getattr(module, cand, None)
            if fn is not None:
                return fn
        raise CannotRunError(
            f"the installed DeepGEMM ({getattr(module, '__version__', '?')}) has no {name} or any "
            "of its aliases; use --backend packaged or reference"
        )

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        return self._function(spec)

    def version(self) -> str | None:
        try:
            mod = import_deep_gemm()
        except CannotRunError:
            return None
        return str(getattr(mod, "__version__", "unknown"))

    def apply_settings(self, recorded: dict[str, Any]) -> list[str]:
        """Re-apply DeepGEMM's recorded process-global settings; return what could not be."""
        mod = import_deep_gemm()
        notes = []
        setters = {
            "num_sms": "set_num_sms",
            "tc_util": "set_tc_util",
            "pdl": "set_pdl",
            "mk_alignment": "set_mk_alignment_for_contiguous_layout",
        }
        values = dict(recorded.get("settings", {}))
        for key in setters:
            if key in recorded and key not in values:
                values[key] = recorded[key]
        for key, value in values.items():
            setter = getattr(mod, setters.get(key, key), None)
            if setter is None or value is None:
                continue
            try:
                setter(value)
            except Exception as exc:
                notes.append(f"could not re-apply {key}={value}: {type(exc).__name__}: {exc}")
        rec_version = recorded.get("version")
        here = getattr(mod, "__version__", None)
        if rec_version and here and str(rec_version) != str(here):
            notes.append(f"DeepGEMM version differs: recorded {rec_version}, here {here}")
        return notes


class PackagedBackend(Backend):
    """kdump's own grouped FP8 GEMM (kdump.kernels.sm120), compiled with NVRTC at run time."""

    name = "packaged"

    def _api(self) -> Any:
        try:
            from kdump.kernels.sm120 import api
        except ImportError as exc:
            raise CannotRunError(
                f"the packaged kernel cannot load ({exc}); install kdump-gpu[kernel]"
            ) from None
        return api

    def available(self, spec: KernelSpec, device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, "the packaged kernel needs a CUDA GPU"
        try:
            api = self._api()
        except CannotRunError as exc:
            return False, str(exc)
        ok, why = api.is_available()
        if not ok:
            return False, why
        if getattr(api, _function_name(spec), None) is None:
            return False, f"the packaged kernel does not implement {spec.id}"
        return True, ""

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        fn = getattr(self._api(), _function_name(spec), None)
        if fn is None:
            raise CannotRunError(f"the packaged kernel does not implement {spec.id}")
        return fn

    def version(self) -> str | None:
        from kdump import __version__

        return f"kdump {__version__}"


class FaultyPackagedBackend(PackagedBackend):
    """Fault injection, never chosen by `auto`: the packaged contiguous kernel with a tile
    schedule planned from the FIRST call's routing labels and reused afterwards (see
    `kdump.kernels.sm120.api.StaleScheduleContiguous`). Eager with fresh buffers and identical
    graph replays are clean; a replay after the labels changed to more active tiles writes past
    the end of d. It exists to prove that graph and sanitizer modes catch this bug class."""

    name = "packaged-faulty"
    _instance: Any = None

    def available(self, spec: KernelSpec, device: torch.device) -> tuple[bool, str]:
        ok, why = super().available(spec, device)
        if ok and not spec.id.endswith(":m_grouped_fp8_gemm_nt_contiguous"):
            return False, "the fault-injection variant implements the contiguous layout only"
        return ok, why

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        if FaultyPackagedBackend._instance is None:
            FaultyPackagedBackend._instance = self._api().make_faulty_contiguous()
        return FaultyPackagedBackend._instance


class LibraryBackend(Backend):
    """The recorded target itself, imported by its 'module:qualname' (generic targets)."""

    name = "library"

    def available(self, spec: KernelSpec, device: torch.device) -> tuple[bool, str]:
        return True, ""

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        module, _, qualname = target.partition(":")
        if not qualname:
            raise UsageError(f"target {target!r} is not 'module:qualname'")
        if module.startswith("torch.ops."):
            obj: Any = torch.ops
            parts = [*module.split(".")[2:], *qualname.split(".")]
        else:
            try:
                obj = importlib.import_module(module)
            except ImportError as exc:
                raise CannotRunError(f"cannot import {module} to replay {target}: {exc}") from None
            parts = qualname.split(".")
        for part in parts:
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise CannotRunError(f"{target}: {part!r} not found in the installed {module}")
        return obj


_BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        ReferenceBackend(),
        DeepGemmBackend(),
        PackagedBackend(),
        LibraryBackend(),
        FaultyPackagedBackend(),
    )
}


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


def choose_backend(name: str, spec: KernelSpec, device: torch.device) -> Backend:
    """Resolve 'auto' (installed library on a GPU, else packaged on a GPU, else the reference,
    else the recorded target) and check that the chosen backend can run here."""
    if name != "auto":
        backend = get_backend(name)
        ok, why = backend.available(spec, device)
        if not ok:
            raise CannotRunError(f"backend {name} cannot run {spec.id} here: {why}")
        return backend
    order = ["deep_gemm", "packaged"] if _is_deepgemm(spec) else []
    order += ["reference", "library"]
    for cand in order:
        backend = _BACKENDS[cand]
        if backend.available(spec, device)[0]:
            return backend
    raise CannotRunError(f"no backend can run {spec.id} on {device}")
