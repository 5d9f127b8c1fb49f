"""Typed replay options: what the CLI builds, `replay()` runs and a child process receives.

The choices of mode, tool and backend are defined here once; the CLI offers exactly these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kdump.errors import UsageError
from kdump.kernels.registry import backend_names

MODES = ("eager", "graph", "sanitizer", "all")
CHILD_MODES = ("eager", "graph")  # what one child process runs; the others combine them
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
PLACEMENTS = ("halo", "flush_end")
# auto: a fresh-process eager oracle for targets without a reference; fresh: for every target;
# off: none (what an oracle process itself runs with).
ORACLES = ("auto", "fresh", "off")
DEFAULT_HALO = 4096  # bytes of poisoned guard before and after every storage
# How `--routing NAME:LAYOUT` reads a kernel's routing argument (kdump.replay.graph_routing):
# labels: a row's group, negative = invalid row; counts: valid rows of each group (masked_m).
ROUTING_LAYOUTS = ("labels", "counts")


@dataclass(frozen=True)
class GraphOptions:
    """Graph mode: the synthesised mutations, and where a restarted chain goes on from."""

    mutations: int = 3  # random routing draws on top of the fixed synthesised phases
    seed: int = 0
    skip_steps: tuple[str, ...] = ()  # steps a previous process of the same chain ran
    # NAME:LAYOUT of the routing argument (ROUTING_LAYOUTS), for a kernel whose spec names none;
    # the shrinking-batch step rewrites it. None: the spec's, if it has one.
    routing: str | None = None

    def __post_init__(self) -> None:
        if self.routing is not None:
            parse_routing(self.routing)

    @property
    def routing_arg(self) -> tuple[str, str] | None:
        """(argument name, layout) of `routing`, or None."""
        return parse_routing(self.routing) if self.routing is not None else None


@dataclass(frozen=True)
class SanitizerOptions:
    """Sanitizer mode: which compute-sanitizer, with which tools, on which kernels."""

    tools: tuple[str, ...] = ("memcheck",)
    graph: bool = False  # also run the graph chain under each tool
    binary: str | None = None  # compute-sanitizer; None: look it up
    kernel_filter: str | None = None  # only kernels whose name contains this
    log_dir: str | None = None  # keep the raw reports here


@dataclass(frozen=True)
class ReplayOptions:
    mode: str = "eager"
    backend: str = "auto"
    device: str = "auto"
    repeat: int = 2  # eager runs; runs after the first must agree with it (within tolerance)
    bitwise: bool = False  # float differences within tolerance are failures, not notes
    oracle: str = "auto"  # see ORACLES
    force: bool = False  # launch even when the call violates the contract
    timeout: float | None = 600.0  # seconds before a replay counts as a hang
    interpreter_budget: float = 120.0  # seconds the Triton interpreter oracle may run a launch
    halo: int = DEFAULT_HALO  # bytes of poisoned guard (0 = off)
    placement: str = "halo"  # flush_end: storages end flush with their allocation (sanitizer)
    reference: bool = True  # compare with the torch reference where the spec has one
    then: tuple[str, ...] = ()  # graph: OTHER.kdump[:CALL] replayed into the captured graph
    save_failing: str | None = None  # graph: folder for a bundle per failing replay
    isolate: bool = True  # run each replay in a child process
    jobs: int = 1  # replays at once (one per GPU)
    # Trust: targets (globs) run beyond the plug-ins', folders the child imports from, recorded
    # environment variables applied to the replay.
    allow_targets: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    apply_env: tuple[str, ...] = ()
    graph: GraphOptions = field(default_factory=GraphOptions)
    sanitizer: SanitizerOptions = field(default_factory=SanitizerOptions)
    # The mode was chosen for the bundle (not given): a call where production died of a GPU
    # fault escalates to memcheck when the plain replay finds nothing (kdump.replay.escalate).
    escalate: bool = False

    def __post_init__(self) -> None:
        for name in ("allow_targets", "paths", "apply_env"):  # one name given as a string
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        _choice("mode", self.mode, MODES)
        _choice("backend", self.backend, backend_names())
        _choice("placement", self.placement, PLACEMENTS)
        _choice("oracle", self.oracle, ORACLES)
        for tool in self.sanitizer.tools:
            _choice("sanitizer tool", tool, TOOLS)
        if not self.sanitizer.tools:
            raise UsageError("no sanitizer tool given; pass --tool memcheck (or another)")
        if self.repeat < 1:
            raise UsageError(f"repeat must be at least 1, not {self.repeat}")
        if self.halo < 0:
            raise UsageError(f"halo must be 0 or more bytes, not {self.halo}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplayOptions:
        """Inverse of `to_dict`; an unknown key is a UsageError (a request from another kdump)."""
        return _build(cls, d, "")

    def for_child(self, mode: str) -> ReplayOptions:
        """The options of one child process running `mode` (eager or graph)."""
        _choice("child mode", mode, CHILD_MODES)
        return replace(self, mode=mode, escalate=False)

    def for_sanitizer(self, mode: str) -> ReplayOptions:
        """One run under compute-sanitizer: storages end flush with their allocation (slack would
        hide near out-of-bounds accesses), no halo, no reference, a single run."""
        return replace(
            self.for_child(mode),
            placement="flush_end",
            halo=0,
            reference=False,
            repeat=1,
            oracle="off",
        )

    def for_oracle(self) -> ReplayOptions:
        """A fresh-process eager oracle: one run of the inputs it is given, nothing else."""
        return replace(
            self.for_child("eager"),
            repeat=1,
            reference=False,
            oracle="off",
            then=(),
            save_failing=None,
            graph=GraphOptions(),
        )

    def refuse_inapplicable(self) -> None:
        """Options that mean nothing in the chosen mode are a usage error, not silently ignored."""
        # the graph chain runs in graph and all modes, and under the sanitizer with --graph
        graphy = self.mode in ("graph", "all") or (
            self.mode == "sanitizer" and self.sanitizer.graph
        )
        where = "--mode graph (or all, or sanitizer with --graph)"
        if self.then and not graphy:
            raise UsageError(f"--then applies to {where}, not {self.mode}")
        if self.save_failing and not graphy:
            raise UsageError(f"--save-failing applies to {where}, not {self.mode}")
        if self.graph.routing is not None and not graphy:
            raise UsageError(f"--routing applies to {where}, not {self.mode}")
        if self.oracle == "fresh" and self.mode == "sanitizer":
            raise UsageError("--oracle fresh applies to --mode eager, graph or all, not sanitizer")

    def wants_fresh_oracle(self, has_reference: bool) -> bool:
        return self.oracle == "fresh" or (self.oracle == "auto" and not has_reference)


def parse_routing(text: str) -> tuple[str, str]:
    """'NAME:LAYOUT' -> (NAME, LAYOUT); a UsageError that says what to write otherwise."""
    name, sep, layout = str(text).rpartition(":")
    if not sep or not name.strip() or layout not in ROUTING_LAYOUTS:
        raise UsageError(
            f"--routing {text}: write NAME:labels (a row's group, -1 marks an invalid row) or "
            "NAME:counts (the valid rows of each group, like masked_m)"
        )
    return name.strip(), layout


def _choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")


_NESTED: dict[str, type] = {"graph": GraphOptions, "sanitizer": SanitizerOptions}


def _build(cls: type, d: Mapping[str, Any], prefix: str) -> Any:
    if not isinstance(d, Mapping):
        raise UsageError(f"replay options {prefix}: expected a mapping, not {type(d).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise UsageError(
            f"unknown replay option(s) {', '.join(prefix + k for k in unknown)}; known: "
            f"{', '.join(prefix + k for k in known)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in d.items():
        if cls is ReplayOptions and name in _NESTED:
            value = _build(_NESTED[name], value, f"{name}.")
        elif isinstance(value, list):
            value = tuple(value)  # JSON has no tuples
        kwargs[name] = value
    return cls(**kwargs)


# The flat keyword names of the options, as `kdump.replay.replay()` and `kdump replay` take them:
# name -> (section, field) of ReplayOptions.
KEYWORDS: dict[str, tuple[str, str]] = {
    "mode": ("", "mode"),
    "backend": ("", "backend"),
    "device": ("", "device"),
    "repeat": ("", "repeat"),
    "force": ("", "force"),
    "timeout": ("", "timeout"),
    "interpreter_budget": ("", "interpreter_budget"),
    "isolate": ("", "isolate"),
    "jobs": ("", "jobs"),
    "halo": ("", "halo"),
    "then": ("", "then"),
    "save_failing": ("", "save_failing"),
    "bitwise": ("", "bitwise"),
    "oracle": ("", "oracle"),
    "allow_targets": ("", "allow_targets"),
    "paths": ("", "paths"),
    "apply_env": ("", "apply_env"),
    "escalate": ("", "escalate"),
    "mutations": ("graph", "mutations"),
    "seed": ("graph", "seed"),
    "routing": ("graph", "routing"),
    "tools": ("sanitizer", "tools"),
    "sanitize_graph": ("sanitizer", "graph"),
    "sanitizer": ("sanitizer", "binary"),
    "kernel_filter": ("sanitizer", "kernel_filter"),
    "sanitizer_log_dir": ("sanitizer", "log_dir"),
}


def from_keywords(base: ReplayOptions | None = None, **kw: Any) -> ReplayOptions:
    """`base` (default: the defaults) with the options named by flat keywords (KEYWORDS)."""
    sections: dict[str, dict[str, Any]] = {"": {}, "graph": {}, "sanitizer": {}}
    for key, value in kw.items():
        if key not in KEYWORDS:
            raise UsageError(f"unknown replay option {key!r}; known: {', '.join(KEYWORDS)}")
        section, name = KEYWORDS[key]
        if isinstance(value, list):
            value = tuple(value)
        sections[section][name] = value
    opts = base or ReplayOptions()
    return replace(
        opts,
        **sections[""],
        graph=replace(opts.graph, **sections["graph"]),
        sanitizer=replace(opts.sanitizer, **sections["sanitizer"]),
    )
