"""The kernel-library plug-in API: everything a plug-in implements and the replayer drives.

One KernelPlugin object per library (DeepGEMM is one): it names the targets the recorder hooks
(presets, aliases), reads and re-applies the library's process-global state, and provides the
specs and backends that replay its calls. Canonical target ids are '<plugin name>:<function>'.

A KernelSpec knows one entry point's signature and argument roles, how to check a call against
the kernel's contract, which output elements are meaningful, how to compute the reference, and
how to generate synthetic calls. A Backend runs a call: the installed library, kdump's packaged
kernel, or the torch reference.

This module is imported by the recorder inside the recorded program: it must not import torch
(tensors appear in annotations only).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from kdump.errors import UsageError

if TYPE_CHECKING:
    import torch


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


@dataclass(frozen=True)
class RoutingSummary:
    """One routing argument of a call summarised per group: what the kernel saw of the token
    distribution (the report's tables and plot, `kdump diff`)."""

    argument: str
    layout: str  # the spec's name for it (DeepGEMM: labels | psum | masked), or histogram
    groups: tuple[int, ...]  # group ids (histogram: the distinct values)
    counts: tuple[int, ...]  # rows (tokens) of each group
    padding: int | None = None  # rows that belong to no group (None: not defined for the layout)
    invalid: int = 0  # values the layout does not allow (out-of-range labels, decreasing ends)
    rows: int | None = None  # rows of the M dimension the layout covers

    @property
    def empty_groups(self) -> tuple[int, ...]:
        return tuple(g for g, c in zip(self.groups, self.counts) if c == 0)

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def count(self, group: int) -> int | None:
        return dict(zip(self.groups, self.counts)).get(group)

    def to_json(self) -> dict[str, Any]:
        return {
            "argument": self.argument,
            "layout": self.layout,
            "groups": list(self.groups),
            "counts": list(self.counts),
            "tokens": self.tokens,
            "empty_groups": list(self.empty_groups),
            "padding": self.padding,
            "invalid": self.invalid,
            "rows": self.rows,
        }


def summarize_histogram(name: str, values: list[int]) -> RoutingSummary:
    """A routing argument without a layout kdump knows: how often each value occurs."""
    tally = sorted(Counter(values).items())
    return RoutingSummary(
        name,
        "histogram",
        tuple(v for v, _ in tally),
        tuple(c for _, c in tally),
        rows=len(values),
    )


@dataclass(frozen=True)
class RowsUsed:
    """What a call reads of its activations and weights (slim drops the rest of a bundle)."""

    rows: torch.Tensor | None  # bool over the activations' leading dimensions
    groups: torch.Tensor  # bool [G]: the weight groups (first dimension) the call reads


class RecordedArgs(Protocol):
    """A recorded call's arguments by parameter name, read without materialising the call (the
    report and slim read one small tensor at a time from a bundle). An argument's tensor is the
    first tensor in its tree (the data of a (data, scales) pair)."""

    def value(self, name: str) -> Any:
        """The argument as recorded (scalars as they are, tensors encoded)."""
        ...

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of the argument's tensor (None: it holds none)."""
        ...

    def dtype(self, name: str) -> str | None:
        """The dtype name of the argument's tensor ('int32')."""
        ...

    def read(self, name: str) -> torch.Tensor | None:
        """The argument's tensor on the CPU."""
        ...


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

    # --- routing: the report's tables and plot, slim --------------------------------------------
    def routing(self, args: RecordedArgs) -> list[RoutingSummary]:
        """Each routing argument (role ROUTING) that is a 1-D integer tensor, summarised per
        group (`summarize_routing`)."""
        out = []
        for name in self.names_with_role(Role.ROUTING):
            shape, values = args.shape(name), None
            if shape is not None and len(shape) == 1 and args.dtype(name) in ("int32", "int64"):
                values = args.read(name)
            if values is not None:
                out.append(self.summarize_routing(name, [int(v) for v in values.tolist()], args))
        return out

    def summarize_routing(self, name: str, values: list[int], args: RecordedArgs) -> RoutingSummary:
        """One routing argument per group, in the layout the library gives it (its other
        arguments in `args`); a histogram of its values for a layout the spec does not know."""
        return summarize_histogram(name, values)

    def rows_used(self, args: RecordedArgs) -> RowsUsed | None:
        """The activation rows and weight groups the call reads, from its routing; None when
        it may read everything."""
        return None

    # --- library settings ----------------------------------------------------------------------
    def library(self) -> str | None:
        """Name of the kernel library whose global settings matter (for envinfo), if any."""
        return None

    def with_settings(self, settings: Mapping[str, Any] | None) -> KernelSpec:
        """This spec configured with the library's recorded global settings by name (its
        plug-in's KernelPlugin.settings, e.g. DeepGEMM's mk_alignment); self when they change
        nothing."""
        return self

    def with_names(self, names: Sequence[str] | None) -> KernelSpec:
        """This spec binding positional arguments by `names`: the parameter names of the build
        that ran the call, as the bundle recorded them (libraries whose argument order differs
        between builds); self when the spec binds by its own table only."""
        return self

    def refusal(self, bound: Mapping[str, Any]) -> str | None:
        """Why this call cannot be replayed at all, in one line (raw pointers into memory the
        bundle does not hold, a Python callable as an argument), or None. `bound` may hold
        decoded values or the bundle's encoded argument trees; must not launch anything."""
        return None


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
    # parameters whose integers are raw device addresses (another rank's memory): recorded
    # as kdump.format.argtree.Pointer, never dereferenced
    pointer_params: tuple[str, ...] = ()

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

    def param_names(self, target_id: str, fn: Any) -> tuple[str, ...] | None:
        """Positional parameter names of `fn`, the installed callable a hook of this library
        wraps, read from the running build (extension docstrings, torch.ops schemas) where
        `inspect.signature` cannot; None to use the target's table."""
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
