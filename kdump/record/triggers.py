"""When a hooked call is dumped: trigger policy and per-process limits (pure logic, no torch).

A call is *selected* when it passes every criterion that was given (they combine with AND):
call-index ranges, every N-th call, the first K calls per tensor signature, and a predicate.
With no criterion at all every call is selected, except when the exception trigger is on: then
only calls that raise are dumped (`--on-exception` alone).

Cost model, because the hook runs on the host program's hot path:
  - `Trigger.consider(i)` is the only thing an armed hook evaluates on every call. It looks at the
    call index alone (a precomputed closure), so a call that is not dumped costs a few hundred ns.
  - Signature and predicate checks (`Trigger.select`) run only for calls `consider` let through.
  - The exception trigger needs the pre-call snapshot of every call it might dump, because after
    a call raised nothing may be read from the GPU (the CUDA context may be dead). So
    `on_exception` makes every call that is not otherwise selected take a full input snapshot,
    which is then thrown away when the call returns normally: costly. It is therefore OFF by
    default for `kdump.recording()` and `kdump record`, and ON for `kdump.dump_call` (one call,
    snapshot taken anyway).

Rank filtering happens per process (`rank_allowed`); limits (`Limits`) count what one process
wrote.
"""

from __future__ import annotations

import bisect
import importlib
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kdump.config import parse_bytes
from kdump.errors import UsageError

KEEP_CHOICES = ("oldest", "newest")


# ---------------------------------------------------------------------------------------------
# Index ranges


@dataclass(frozen=True)
class RangeSet:
    """A set of non-negative integers written as '0-9,100,200-' (inclusive; '200-' is open)."""

    spans: tuple[tuple[int, int | None], ...]  # sorted, merged (lo, hi inclusive or None = open)

    def __contains__(self, i: object) -> bool:
        if not isinstance(i, int):
            return False
        k = bisect.bisect_right(self._los, i) - 1
        if k < 0:
            return False
        hi = self.spans[k][1]
        return hi is None or i <= hi

    @property
    def _los(self) -> list[int]:
        # Cached on first use (frozen dataclass: stored through object.__setattr__).
        try:
            return self.__dict__["_los_cache"]
        except KeyError:
            los = [lo for lo, _ in self.spans]
            object.__setattr__(self, "_los_cache", los)
            return los

    @property
    def exhausted_after(self) -> int | None:
        """The last member, or None when the set is open-ended (or empty: -1)."""
        if not self.spans:
            return -1
        return self.spans[-1][1]

    def __str__(self) -> str:
        parts = []
        for lo, hi in self.spans:
            parts.append(f"{lo}-" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}"))
        return ",".join(parts)


_RANGE_RE = re.compile(r"^\s*(\d+)\s*(?:(-)\s*(\d+)?)?\s*$")


def parse_ranges(text: str | Iterable[int]) -> RangeSet:
    """Parse '0-9,100,200-' (or take an iterable of ints). Raises UsageError on bad input."""
    spans: list[tuple[int, int | None]] = []
    if isinstance(text, str):
        for part in text.split(","):
            if not part.strip():
                continue
            m = _RANGE_RE.match(part)
            if not m:
                raise UsageError(
                    f"bad call/rank range {part.strip()!r} in {text!r}: use e.g. '0-9,100,200-'"
                )
            lo = int(m.group(1))
            hi: int | None = lo
            if m.group(2):
                hi = int(m.group(3)) if m.group(3) is not None else None
            if hi is not None and hi < lo:
                raise UsageError(f"bad range {part.strip()!r}: the end is before the start")
            spans.append((lo, hi))
    else:
        for i in text:
            if not isinstance(i, int) or i < 0:
                raise UsageError(f"bad index {i!r}: indices are non-negative integers")
            spans.append((i, i))
    spans.sort(key=lambda s: s[0])
    merged: list[tuple[int, int | None]] = []
    for lo, hi in spans:
        if merged:
            plo, phi = merged[-1]
            if phi is None or lo <= phi + 1:
                new_hi = None if phi is None or hi is None else max(phi, hi)
                merged[-1] = (plo, new_hi)
                continue
        merged.append((lo, hi))
    return RangeSet(tuple(merged))


def parse_positive(text: str | int, what: str) -> int:
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise UsageError(f"{what} must be a positive integer, not {text!r}")
    if n <= 0:
        raise UsageError(f"{what} must be a positive integer, not {n}")
    return n


# ---------------------------------------------------------------------------------------------
# Signatures and predicates


def tensor_signature(args: Iterable[Any], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """(path, shape, dtype, stride, layout) of every tensor argument, nested containers included."""
    torch = sys.modules.get("torch")
    if torch is None:  # no torch loaded: no tensors can be among the arguments
        return ()
    tensor_type = torch.Tensor
    out: list[tuple[Any, ...]] = []

    def walk(v: Any, path: str, depth: int) -> None:
        if isinstance(v, tensor_type):
            out.append((path, tuple(v.shape), str(v.dtype), tuple(v.stride()), str(v.layout)))
        elif depth < 8 and isinstance(v, (tuple, list)):
            for j, x in enumerate(v):
                walk(x, f"{path}[{j}]", depth + 1)
        elif depth < 8 and isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}[{k!r}]", depth + 1)

    for j, a in enumerate(args):
        walk(a, str(j), 0)
    for k, a in kwargs.items():
        walk(a, k, 0)
    return tuple(out)


def load_predicate(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """A predicate given as a callable or as 'module:function' (imported here)."""
    if callable(spec):
        return spec
    module, sep, name = str(spec).partition(":")
    if not sep or not module or not name:
        raise UsageError(f"predicate {spec!r} must be 'module:function'")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise UsageError(f"cannot load predicate {spec!r}: {type(exc).__name__}: {exc}")
    if not callable(obj):
        raise UsageError(f"predicate {spec!r} is not callable")
    return obj


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class TriggerConfig:
    """What to dump. None means 'criterion not given'."""

    calls: RangeSet | None = None
    every: int | None = None
    first_per_signature: int | None = None
    ranks: RangeSet | None = None
    predicate: str | Callable[..., Any] | None = None
    max_bundles: int | None = None
    max_bytes: int | None = None
    keep: str = "oldest"
    on_exception: bool = False

    def __post_init__(self) -> None:
        if self.keep not in KEEP_CHOICES:
            raise UsageError(f"keep must be one of {', '.join(KEEP_CHOICES)}, not {self.keep!r}")
        for name in ("every", "first_per_signature", "max_bundles"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise UsageError(f"{name} must be a positive integer, not {v!r}")
        mb = self.max_bytes
        if mb is not None and (not isinstance(mb, int) or mb <= 0):
            raise UsageError(f"max_bytes must be a positive integer, not {self.max_bytes!r}")

    @property
    def has_selection(self) -> bool:
        given = (self.calls, self.every, self.first_per_signature, self.predicate)
        return any(v is not None for v in given)

    @classmethod
    def build(
        cls,
        *,
        calls: str | Iterable[int] | RangeSet | None = None,
        every: int | str | None = None,
        first_per_signature: int | str | None = None,
        ranks: str | Iterable[int] | RangeSet | None = None,
        predicate: str | Callable[..., Any] | None = None,
        max_bundles: int | str | None = None,
        max_bytes: int | str | None = None,
        keep: str = "oldest",
        on_exception: bool = False,
    ) -> TriggerConfig:
        """Parse user-facing values (strings from the CLI / environment, or Python values)."""

        def rng(v: Any) -> RangeSet | None:
            if v is None or isinstance(v, RangeSet):
                return v
            if isinstance(v, int):
                return parse_ranges([v])
            return parse_ranges(v)

        return cls(
            calls=rng(calls),
            every=None if every is None else parse_positive(every, "every"),
            first_per_signature=None
            if first_per_signature is None
            else parse_positive(first_per_signature, "first_per_signature"),
            ranks=rng(ranks),
            predicate=predicate,
            max_bundles=None if max_bundles is None else parse_positive(max_bundles, "max_bundles"),
            max_bytes=None if max_bytes is None else parse_bytes(max_bytes),
            keep=str(keep).lower(),
            on_exception=bool(on_exception),
        )


# ---------------------------------------------------------------------------------------------
# Per-target trigger state

Warn = Callable[[str, str], None]  # (key, message): log once per key


@dataclass
class Trigger:
    """Decides, per call of one target in one process, whether to snapshot and dump it."""

    config: TriggerConfig
    warn: Warn = field(default=lambda key, msg: None)
    _seen: dict[tuple[Any, ...], int] = field(default_factory=dict)
    _predicate: Callable[..., Any] | None = None
    _predicate_broken: bool = False

    def __post_init__(self) -> None:
        self.consider = self._make_consider()
        # `select` without a selection (every recorded call asks): its answer, found once
        self._plain = None if self.config.has_selection else not self.config.on_exception

    def reset(self) -> None:
        """Forget per-process state (after fork)."""
        self._seen.clear()

    def _make_consider(self) -> Callable[[int], bool]:
        """The hot-path check: can call `i` be dumped at all (selected, or exception trigger)?"""
        cfg = self.config
        if cfg.on_exception:
            return _always  # every call needs its pre-call snapshot (documented cost)
        if not cfg.has_selection:
            return _always
        calls, every = cfg.calls, cfg.every
        if calls is not None:
            in_calls = _range_check(calls)
            if every is not None:
                return lambda i: i % every == 0 and in_calls(i)
            return in_calls
        if every is not None:
            return lambda i: i % every == 0
        return _always  # signature / predicate: decided in select()

    def select(self, index: int, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        """Is call `index` dumped whether or not it raises? (Only after consider(index).)"""
        if self._plain is not None:
            return self._plain
        cfg = self.config
        if cfg.calls is not None and index not in cfg.calls:
            return False
        if cfg.every is not None and index % cfg.every:
            return False
        if cfg.predicate is not None and not self._predicate_says_yes(args, kwargs):
            return False
        if cfg.first_per_signature is not None:
            sig = tensor_signature(args, kwargs)
            n = self._seen.get(sig, 0)
            if n >= cfg.first_per_signature:
                return False
            self._seen[sig] = n + 1
        return True

    def _predicate_says_yes(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        if self._predicate_broken:
            return False
        try:
            if self._predicate is None:
                self._predicate = load_predicate(self.config.predicate)  # type: ignore[arg-type]
            return bool(self._predicate(*args, **kwargs))
        except Exception as exc:  # a broken predicate disables itself, never the host program
            self._predicate_broken = True
            self.warn(
                f"predicate:{self.config.predicate}",
                f"predicate {self.config.predicate} failed ({type(exc).__name__}: {exc}); "
                "it is disabled and selects no more calls",
            )
            return False

    def is_exhausted(self, index: int) -> bool:
        """True when no call after `index` can ever be dumped (lets the hook disarm itself)."""
        cfg = self.config
        if cfg.on_exception or cfg.calls is None:
            return False
        last = cfg.calls.exhausted_after
        return last is not None and index >= last


def _range_check(r: RangeSet) -> Callable[[int], bool]:
    """A closure over plain locals: cheaper than RangeSet.__contains__ on the hot path."""
    los = [lo for lo, _ in r.spans]
    his = [hi for _, hi in r.spans]
    find = bisect.bisect_right

    def check(i: int) -> bool:
        k = find(los, i) - 1
        return k >= 0 and (his[k] is None or i <= his[k])  # type: ignore[operator]

    return check


def _always(i: int) -> bool:
    return True


def rank_allowed(ranks: RangeSet | None, rank: int | None) -> bool:
    """Whether a process of `rank` records. An unknown rank counts as rank 0 (single process)."""
    if ranks is None:
        return True
    return (0 if rank is None else rank) in ranks


# ---------------------------------------------------------------------------------------------
# Per-process limits


@dataclass(frozen=True)
class Written:
    """One bundle this process wrote, with the bytes it added on disk."""

    path: str
    target: str
    index: int
    nbytes: int
    exception: str | None = None


@dataclass
class Limits:
    """max_bundles / max_bytes per process. keep=oldest stops writing; keep=newest evicts.

    The recorder calls `admit()` before snapshotting (can anything be written at all?), `add()`
    after writing a bundle (with the bytes it added on disk), then takes `victim()` until it is
    None, deleting each and reporting the bytes that really left the disk with `freed()` (blobs
    shared with surviving bundles stay, so that can be less than the bundle's own count).
    """

    max_bundles: int | None = None
    max_bytes: int | None = None
    keep: str = "oldest"
    bundles: list[Written] = field(default_factory=list)
    total_bytes: int = 0
    stopped: bool = False

    def admit(self) -> bool:
        return not self.stopped

    def add(self, w: Written) -> None:
        self.bundles.append(w)
        self.total_bytes += w.nbytes

    def _over(self) -> bool:
        return (self.max_bundles is not None and len(self.bundles) > self.max_bundles) or (
            self.max_bytes is not None and self.total_bytes > self.max_bytes
        )

    def victim(self) -> Written | None:
        """The next bundle to delete, or None when within the limits."""
        if self.keep == "oldest":
            if self._over():
                self.stopped = True  # the bundle that broke the limit goes; nothing more is written
                return self.bundles.pop()
            full = (self.max_bundles is not None and len(self.bundles) >= self.max_bundles) or (
                self.max_bytes is not None and self.total_bytes >= self.max_bytes
            )
            if full:
                self.stopped = True
            return None
        if self._over() and self.bundles:
            return self.bundles.pop(0)
        return None

    def freed(self, nbytes: int) -> None:
        self.total_bytes -= nbytes
