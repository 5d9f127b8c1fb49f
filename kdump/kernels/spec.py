"""The kernel-spec and backend interfaces that the replayer drives.

A spec knows one entry point's signature and argument roles, how to check a call against the
kernel's contract, which output elements are meaningful, how to compute the reference, and how to
generate synthetic calls. A backend runs a call: the installed library, kdump's packaged kernel, or
the torch reference.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from kdump.errors import UsageError


class Role(str, Enum):
    INPUT = "input"  # read by the kernel
    WEIGHT = "weight"  # read by the kernel and the same across calls (the recorder copies it once)
    OUTPUT = "output"  # written in place by the kernel
    ROUTING = "routing"  # routing metadata (grouped_layout, masked_m): mutated by graph replays
    SCALAR = "scalar"  # changes the computation (recipe, flags)
    HINT = "hint"  # performance hint only (expected_m, compiled_dims)


_EMPTY = inspect.Parameter.empty


@dataclass(frozen=True)
class Param:
    name: str
    role: Role
    default: Any = _EMPTY
    aliases: tuple[str, ...] = ()  # older argument names (e.g. m_indices for grouped_layout)


@dataclass(frozen=True)
class Touch:
    """Which rows of a parameter's tensors a call can read (the flight recorder snapshots only
    those). `rule`: "all" (every row), "labels" (rows whose int32 label in `by` is >= 0),
    "masked" (rows m < by[g] of batch g; the first two dimensions index rows), "psum" (rows
    [align(by[g-1]), by[g]) with the spec's alignment). Every tensor of `param` (a tensor or a
    tuple such as FP8 data and its scales) shares the row numbering of its first
    `row_dims` dimensions."""

    param: str
    rule: str = "all"
    by: str | None = None
    row_dims: int = 1
    alignment: int = 1


@dataclass(frozen=True)
class Tolerance:
    """When results count as equal to the reference."""

    calc_diff: float  # DeepGEMM's metric threshold
    atol: float  # per-element: |x - y| <= atol + rtol * |y|
    rtol: float


@dataclass
class Violation:
    """A way the call breaks the kernel's contract."""

    argument: str
    message: str

    def __str__(self) -> str:
        return f"{self.argument}: {self.message}"


@dataclass
class Mutation:
    """New values for routing metadata (and inputs), written in place for a graph replay."""

    name: str
    values: dict[str, torch.Tensor] = field(default_factory=dict)


class KernelSpec:
    """Base class of entry-point specs. Subclasses set `id`, `aliases`, `params`."""

    id: str = ""
    aliases: tuple[str, ...] = ()
    params: tuple[Param, ...] = ()

    # --- binding -------------------------------------------------------------------------------
    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments by parameter name (defaults applied); older keyword names accepted."""
        if len(args) > len(self.params):
            raise UsageError(
                f"{self.id}: {len(args)} positional arguments, at most {len(self.params)}"
            )
        bound: dict[str, Any] = {}
        for p, a in zip(self.params, args):
            bound[p.name] = a
        by_alias = {al: p.name for p in self.params for al in (p.name, *p.aliases)}
        for k, v in kwargs.items():
            name = by_alias.get(k)
            if name is None:
                raise UsageError(f"{self.id}: unexpected argument {k!r}")
            if name in bound:
                raise UsageError(f"{self.id}: argument {name!r} given twice")
            bound[name] = v
        for p in self.params:
            if p.name not in bound:
                if p.default is _EMPTY:
                    raise UsageError(f"{self.id}: missing argument {p.name!r}")
                bound[p.name] = p.default
        return bound

    def param_names(self) -> list[str]:
        return [p.name for p in self.params]

    def names_with_role(self, *roles: Role) -> list[str]:
        return [p.name for p in self.params if p.role in roles]

    def output_names(self, bound: Mapping[str, Any]) -> list[str]:
        return self.names_with_role(Role.OUTPUT)

    def touches(self, bound: Mapping[str, Any]) -> tuple[Touch, ...]:
        """Inputs of which a call reads only some rows, and the rule that says which; inputs
        not listed count as read whole."""
        return ()

    # --- contract ------------------------------------------------------------------------------
    def validate(self, bound: Mapping[str, Any]) -> list[Violation]:
        """Contract violations of this call (empty when it is valid). Must not launch anything."""
        return []

    # --- results -------------------------------------------------------------------------------
    def has_reference(self) -> bool:
        return False

    def reference(self, bound: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Expected value of each output, computed with torch on the arguments' device."""
        raise NotImplementedError(f"{self.id} has no reference")

    def meaningful(self, bound: Mapping[str, Any], output: str) -> torch.Tensor | None:
        """Boolean mask (broadcastable to the output) of elements the kernel promises to write,
        or None for all of them."""
        return None

    def tolerance(self, bound: Mapping[str, Any]) -> Tolerance:
        return Tolerance(calc_diff=1e-3, atol=1e-2, rtol=1e-2)

    # --- synthesis -----------------------------------------------------------------------------
    def generate(
        self, seed: int = 0, device: str = "cpu", **shape: Any
    ) -> tuple[list[Any], dict[str, Any]]:
        """A synthetic call (args, kwargs) with random data."""
        raise NotImplementedError(f"{self.id} has no generator")

    def mutations(
        self, bound: Mapping[str, Any], seed: int = 0, count: int = 0
    ) -> Iterator[Mutation]:
        """Shape-preserving changes of routing metadata for graph replays."""
        return iter(())

    # --- library settings ----------------------------------------------------------------------
    def library(self) -> str | None:
        """Name of the kernel library whose global settings matter (for envinfo), if any."""
        return None

    def with_settings(self, settings: Mapping[str, Any] | None) -> KernelSpec:
        """This spec configured with the library's recorded global settings by name (its
        plug-in's KernelPlugin.settings, e.g. DeepGEMM's mk_alignment); self when they change
        nothing."""
        return self


class Backend:
    """Runs calls of a spec."""

    name: str = ""

    def available(self, spec: KernelSpec, device: torch.device) -> tuple[bool, str]:
        """Whether this backend can run `spec` on `device`, and if not, what to do about it."""
        raise NotImplementedError

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        """The callable to invoke with the recorded (args, kwargs)."""
        raise NotImplementedError

    def version(self) -> str | None:
        return None
