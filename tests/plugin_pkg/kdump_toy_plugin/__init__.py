"""A third-party kernel library with its own kdump plug-in (registered through the
"kdump.kernels" entry-point group by tests/test_plugins.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kdump.kernels.plugin import (
    Backend,
    KernelPlugin,
    KernelSpec,
    Param,
    Role,
    TargetSpec,
    Tolerance,
    Violation,
)

NAME = "toy"
TARGET_ID = f"{NAME}:scaled_add"
PARAMS = ("a", "b", "out", "alpha")

# Set by a test to make the library wrong on purpose (a buggy build being recorded).
BUG = False


def scaled_add(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha: float = 1.0) -> None:
    """out = a * alpha + b, in place."""
    torch.add(b, a, alpha=alpha, out=out)
    if BUG:
        out.view(-1)[3] += 1.0


class ScaledAddSpec(KernelSpec):
    id = TARGET_ID
    params = (
        Param("a", Role.INPUT),
        Param("b", Role.INPUT),
        Param("out", Role.OUTPUT),
        Param("alpha", Role.SCALAR, default=1.0),
    )

    def validate(self, bound: Mapping[str, Any]) -> list[Violation]:
        out = []
        for name in ("b", "out"):
            if tuple(bound[name].shape) != tuple(bound["a"].shape):
                out.append(Violation(name, f"shape {tuple(bound[name].shape)} is not a's"))
        return out

    def has_reference(self) -> bool:
        return True

    def reference(self, bound: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        a, b = bound["a"].double(), bound["b"].double()
        return {"out": (a * float(bound["alpha"]) + b).to(bound["out"].dtype)}

    def tolerance(self, bound: Mapping[str, Any]) -> Tolerance:
        return Tolerance(calc_diff=1e-6, atol=1e-5, rtol=1e-5)

    def library(self) -> str | None:
        return NAME


class ToyBackend(Backend):
    """Runs the installed library function."""

    name = "toy"

    def available(self, spec: KernelSpec, device: torch.device) -> tuple[bool, str]:
        if spec.id != TARGET_ID:
            return False, f"{spec.id} is not a toy entry point"
        return True, ""

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        return scaled_add


class ToyPlugin(KernelPlugin):
    name = NAME
    library_backend = "toy"

    def presets(self) -> Mapping[str, Sequence[TargetSpec]]:
        return {NAME: (self._target(),)}

    def _target(self) -> TargetSpec:
        return TargetSpec(
            __name__, "scaled_add", TARGET_ID, output_names=("out",), param_names=PARAMS
        )

    def canonical_id(self, target: str) -> str | None:
        if target in (TARGET_ID, f"{__name__}:scaled_add"):
            return TARGET_ID
        return None

    def target(self, module: str, qualname: str) -> TargetSpec | None:
        return self._target() if self.canonical_id(f"{module}:{qualname}") else None

    def specs(self) -> Sequence[KernelSpec]:
        return (ScaledAddSpec(),)

    def backends(self) -> Sequence[Backend]:
        return (ToyBackend(),)

    def auto_order(self) -> Sequence[str]:
        return ("toy",)


class BrokenPlugin(KernelPlugin):
    """Fails as it is created: the registry must skip it."""

    name = "broken"

    def __init__(self) -> None:
        raise RuntimeError("this plug-in is broken on purpose")

    def presets(self) -> Mapping[str, Sequence[TargetSpec]]:
        return {}

    def specs(self) -> Sequence[KernelSpec]:
        return ()
