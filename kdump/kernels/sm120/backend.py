"""The "packaged" and "packaged-faulty" backends: kdump's own grouped FP8 GEMM for DeepGEMM's
signatures (kdump.kernels.sm120), compiled with NVRTC at run time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kdump.errors import CannotRunError
from kdump.kernels.plugin import Backend, KernelSpec


def _function_name(spec: KernelSpec) -> str:
    return spec.id.partition(":")[2]


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
        from kdump._version import __version__

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


def packaged_check(gpu: bool) -> dict[str, Any]:
    """The `kdump doctor` line of the packaged kernel."""
    try:
        from kdump.kernels.sm120 import api
    except Exception as exc:
        return {
            "name": "backend packaged",
            "ok": False,
            "detail": f"cannot load: {exc}",
            "fix": "pip install 'kdump-gpu[kernel]'",
        }
    ok, why = api.is_available()
    return {
        "name": "backend packaged",
        "ok": ok and gpu,
        "detail": "NVRTC + CUTLASS headers found" if ok else why,
        "fix": "" if ok and gpu else (why if not ok else "needs a CUDA GPU"),
    }
