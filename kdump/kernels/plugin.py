"""The kernel-library plug-in interface: one KernelPlugin object per library (DeepGEMM is one).

A plug-in names the targets the recorder hooks (presets, aliases), reads and re-applies the
library's process-global state, and provides the specs and backends that replay its calls.
Canonical target ids are '<plugin name>:<function>'.

This module is imported by the recorder inside the recorded program: it must not import torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kdump.kernels.spec import Backend, KernelSpec


@dataclass(frozen=True)
class TargetSpec:
    """One thing to patch: an attribute path inside a module (or torch.ops namespace)."""

    module: str
    qualname: str
    id: str  # canonical id ('<plugin>:<function>', or 'module:qualname' without a plug-in)
    kind: str = "call"  # "call": recorded; "setter": only its latest arguments are kept
    optional: bool = False  # preset members that a given build may lack: missing is not an error
    output_names: tuple[str, ...] = ()  # parameters written in place (default outputs)
    param_names: tuple[str, ...] | None = None  # positional parameter names, when known

    @property
    def text(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def is_op(self) -> bool:
        return self.module == "torch.ops" or self.module.startswith("torch.ops.")


class KernelPlugin(ABC):
    """A kernel library kdump knows. Subclasses set `name` and implement the abstract methods;
    the others have defaults for libraries without global state or a library backend."""

    name: str = ""
    # The backend that runs the installed library (a recorded call ran it), if any.
    library_backend: str | None = None

    # --- recording -----------------------------------------------------------------------------
    @abstractmethod
    def presets(self) -> Mapping[str, Sequence[TargetSpec]]:
        """Preset name -> the targets it hooks (setters included, kind="setter")."""

    def canonical_id(self, target: str) -> str | None:
        """The canonical id of `target` ('module:qualname', an alias, a bare function name) when
        it belongs to this library, else None."""
        return None

    def target(self, module: str, qualname: str) -> TargetSpec | None:
        """Hook details (outputs, parameter names) of an explicitly named target of this library,
        or None to hook it as a generic target."""
        return None

    def state(self) -> dict[str, Any] | None:
        """The library's process-global state for the bundle (None when it is not loaded).
        Called at record time; must never import the library or raise."""
        return None

    def note_setter(
        self, target_id: str, qualname: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A hooked setter of this library returned normally: remember its value for state()."""
        return None

    # --- replay --------------------------------------------------------------------------------
    def settings(self, recorded: Mapping[str, Any] | None) -> dict[str, Any]:
        """The recorded state (what state() returned) as settings by name, for
        KernelSpec.with_settings."""
        return {}

    def known_settings(self) -> frozenset[str]:
        """The setting names `apply_state` may apply (each maps to a setter kdump knows). A
        recorded name outside this set is shown, never looked up in the library or called."""
        return frozenset()

    def apply_state(self, recorded: Mapping[str, Any] | None, device: torch.device) -> list[str]:
        """Re-apply the recorded state before a replayed call, known settings only; notes for
        the verdict: what was applied, and what was not (invalid here, or unknown)."""
        return []

    def same_build(self, recorded: Mapping[str, Any] | None, backend: Backend) -> bool:
        """Whether `backend` runs the build the call was recorded with (bitwise comparison)."""
        return True

    @abstractmethod
    def specs(self) -> Sequence[KernelSpec]:
        """One instance of every spec of this library (default settings)."""

    def spec(self, target_id: str) -> KernelSpec | None:
        """The spec of a canonical target id (or an alias id), or None."""
        for spec in self.specs():
            if target_id == spec.id or target_id in {f"{self.name}:{a}" for a in spec.aliases}:
                return spec
        return None

    def backends(self) -> Sequence[Backend]:
        """The backends this library brings (names unique across plug-ins)."""
        return ()

    def auto_order(self) -> Sequence[str]:
        """Backend names `--backend auto` tries, in order, for this library's specs (before the
        generic reference and library backends)."""
        return ()

    def checks(self, gpu: bool) -> list[dict[str, Any]]:
        """`kdump doctor` lines: {"name", "ok", "detail", "fix"}."""
        return []


_SPEC_NAMES = ("Backend", "KernelSpec", "Mutation", "Param", "Role", "Tolerance", "Violation")


def __getattr__(name: str) -> Any:
    # Older importers took the spec types and GenericSpec from here; loaded lazily (torch).
    if name in _SPEC_NAMES:
        from kdump.kernels import spec

        return getattr(spec, name)
    if name == "GenericSpec":
        from kdump.kernels.generic import GenericSpec

        return GenericSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
