"""Outputs found by running: which tensor arguments a call writes, for targets whose spec names
no outputs (a user's own kernel or function).

Run on the recorded values, every argument's storage span is compared, byte by byte, with the
span from before the run (the copy the replay keeps to restore its inputs anyway: no dense copy
of any view): a tensor whose bytes changed is written. A tensor can also be written with the
values it already held (a serving loop's output buffer holds the previous step's result); each
floating-point argument that kept its bytes therefore gets one more run with only it probed with
NaN (all-ones bytes), and counts as written when the run replaces the probe with values. An
argument that is only read keeps the probe. Integer and boolean arguments are never probed: a
changed index or mask could send the kernel past a buffer sized for the recorded values (a crash
of the probe's making); one the call writes with the values it held counts as untouched (the
recorder keeps every argument after the call, so the replay still compares it with production).

A written tensor is also checked for being read: the written tensors are probed together (one
by one when that changes anything) and a tensor whose written elements come out exactly as
before, with the other outputs unchanged too, is write-only. Write-only outputs are poisoned
before every later run (elements the replay leaves unwritten show); outputs that are read and
written get their recorded input values back before every run instead, as every argument does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kdump.bundle import MaterializedCall
from kdump.bundle.materialize import Allocation
from kdump.bundle.tensors import clone_layout
from kdump.replay.compare import _as_int, agree, poison, unwritten

# At most this many probe runs per call; arguments beyond it count as read (said in the note).
MAX_PROBES = 32

WRITTEN, READ_WRITTEN, SAME_VALUES, UNTOUCHED, NOT_PROBED = (
    "written",
    "read and written",
    "written with the values it held",
    "untouched",
    "not probed",
)


@dataclass
class Discovery:
    """What running the call said about its tensor arguments."""

    outputs: dict[str, int] = field(default_factory=dict)  # name -> tensor index
    write_only: set[str] = field(default_factory=set)  # poisoned before every later run
    roles: dict[str, str] = field(default_factory=dict)  # every tensor argument -> how it was used
    runs: int = 0

    def describe(self) -> str:
        parts = [f"{name} ({role})" for name, role in self.roles.items()]
        return "outputs found by running: " + (", ".join(parts) or "no tensor arguments")

    def to_json(self) -> dict[str, Any]:
        return {
            "source": "found by running",
            "outputs": sorted(self.outputs),
            "write_only": sorted(self.write_only),
            "arguments": dict(self.roles),
            "runs": self.runs,
        }


class ProbeFailed(Exception):
    """A discovery run failed in a way that ends the replay (its finding is reported)."""


# Runs the call once with the buffers as they are; raises what the call raised.
RunOnce = Callable[[str], None]


def discover(
    mc: MaterializedCall,
    storage_of: Sequence[int],
    pristine: Sequence[torch.Tensor],
    restore: Callable[[], None],
    run: RunOnce,
    recorded_outputs: Sequence[int] = (),
) -> Discovery:
    """Find the tensors the call writes. `storage_of[i]`: tensor i's storage; `pristine`: every
    allocation's span before the call (allocation order); `restore()` puts them back; `run(step)`
    runs the call once (an exception it raises on the recorded values propagates; one raised
    by a probe run only says the probed argument is read). Tensors in `recorded_outputs` (the
    bundle recorded their values after the call) are outputs whatever the runs say."""
    allocs = mc.materialized.allocations
    by_storage = {a.storage: (j, a) for j, a in enumerate(allocs)}
    names = mc.tensor_names
    found = Discovery()
    tensors = [i for i, t in enumerate(mc.tensors) if t.numel() > 0 and storage_of[i] in by_storage]

    restore()
    run("(recorded values)")
    found.runs += 1
    changed_spans = {j: a.span != pristine[j].to(a.span.device) for j, a in enumerate(allocs)}
    written: dict[int, torch.Tensor] = {}  # tensor index -> elements the run changed
    for i in tensors:
        j, a = by_storage[storage_of[i]]
        flags = _element_flags(mc.tensors[i], a, changed_spans[j])
        if bool(flags.any()):
            written[i] = flags
    first = {i: clone_layout(mc.tensors[i]) for i in written}

    probes = 0
    same_values: list[int] = []
    not_probed: list[int] = []
    for i in sorted((i for i in tensors if i not in written), key=lambda i: mc.tensors[i].numel()):
        t = mc.tensors[i]
        if not _probed_kind(t):
            continue  # never probed: a changed index or mask could make the kernel stray
        if probes >= MAX_PROBES or _overlaps(t):
            not_probed.append(i)
            continue
        probes += 1
        restore()
        original = clone_layout(t)
        _probe(t, original)
        found.runs += 1
        try:
            run(f"({names[i]} probed)")
        except ProbeFailed:
            raise
        except Exception:
            continue  # the call failed on the probe: it reads this argument
        if bool((~_probe_left(t, original)).any()):
            same_values.append(i)

    write_only = _write_only(mc, written, first, restore, run, found)
    for i in tensors:
        name = names[i]
        if i in written:
            found.roles[name] = WRITTEN if i in write_only else READ_WRITTEN
        elif i in same_values:
            found.roles[name] = SAME_VALUES
        elif i in not_probed:
            found.roles[name] = NOT_PROBED
        else:
            found.roles[name] = UNTOUCHED
    for i in [*written, *same_values, *recorded_outputs]:
        found.outputs.setdefault(names[i], i)
    found.write_only = {names[i] for i in write_only}
    restore()
    return found


def _write_only(
    mc: MaterializedCall,
    written: dict[int, torch.Tensor],
    first: dict[int, torch.Tensor],
    restore: Callable[[], None],
    run: RunOnce,
    found: Discovery,
) -> set[int]:
    """The written tensors the call does not read: probed together, then one by one when the
    results moved, a tensor is write-only when every written element of every output comes out
    as in the first run."""
    if not written:
        return set()

    def unchanged_with(probed: Sequence[int], label: str) -> bool:
        if any(_overlaps(mc.tensors[i]) or not _probed_kind(mc.tensors[i]) for i in probed):
            # never poisoned: a view whose elements share bytes, an integer or boolean output
            # (it may be an index or a mask the call also reads)
            return False
        restore()
        for i in probed:
            _probe(mc.tensors[i], clone_layout(mc.tensors[i]))
        found.runs += 1
        try:
            run(label)
        except ProbeFailed:
            raise
        except Exception:
            return False
        return all(_same_where(mc.tensors[i], first[i], written[i]) for i in written)

    names = mc.tensor_names
    floats = [i for i in written if _probed_kind(mc.tensors[i])]
    if floats and unchanged_with(floats, "(outputs probed)"):
        return set(floats)
    out: set[int] = set()
    if len(floats) <= 1:
        return out
    for k, i in enumerate(floats):
        if k >= MAX_PROBES:
            break
        if unchanged_with([i], f"({names[i]} probed)"):
            out.add(i)
    return out


def _probed_kind(t: torch.Tensor) -> bool:
    """Only floating-point arguments are probed (with NaN): an integer or boolean one may be an
    index or a mask, and a changed one could send the kernel anywhere (past a buffer sized for
    the recorded values, on a GPU: a crash that is the probe's, not production's)."""
    return t.dtype.is_floating_point


def _overlaps(t: torch.Tensor) -> bool:
    """Whether elements of `t` share memory (a broadcast view): in-place fills refuse it."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def _same_where(got: torch.Tensor, base: torch.Tensor, where: torch.Tensor) -> bool:
    """`got` equals `base` at `where` (bitwise, or within the dtype tolerance for floats)."""
    return agree(got, base, where).ok


def _probe(t: torch.Tensor, original: torch.Tensor) -> None:
    if t.dtype == torch.bool:
        t.copy_(~original)
    elif t.dtype.is_floating_point:
        poison(t)
    else:
        t.zero_()


def _probe_left(t: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Elements of `t` that still hold the probe `_probe` wrote (over `original`)."""
    if t.dtype == torch.bool:
        return t == ~original
    if t.dtype.is_floating_point:
        return unwritten(t)
    return t == 0


def _element_flags(t: torch.Tensor, a: Allocation, changed: torch.Tensor) -> torch.Tensor:
    """Per element of `t` (a view into allocation `a`): whether any of its bytes is set in
    `changed` (one flag per byte of the span)."""
    flags = torch.zeros(a.buffer.numel(), dtype=torch.uint8, device=a.buffer.device)
    flags[a.span_offset : a.span_offset + a.span_nbytes] = changed.to(torch.uint8)
    size = t.element_size()
    offset = t.data_ptr() - a.buffer.data_ptr()
    view = flags.as_strided((*t.shape, size), (*(s * size for s in t.stride()), 1), offset)
    return view.amax(-1).bool()


def elements_unchanged(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Per element: the same bytes in `before` and `after` (same dtype and shape)."""
    size = before.element_size()
    if size <= 8:
        return _as_int(before) == _as_int(after)
    a = before.contiguous().view(torch.uint8).view(*before.shape, size)  # complex128
    b = after.contiguous().view(torch.uint8).view(*after.shape, size)
    return (a == b).all(-1)


def tensor_view(like: torch.Tensor, a: Allocation, span: torch.Tensor) -> torch.Tensor:
    """The view of `span` (a copy of allocation `a`'s span) that `like` is of `a`."""
    base = torch.zeros(a.buffer.numel(), dtype=torch.uint8, device=span.device)
    base[a.span_offset : a.span_offset + a.span_nbytes] = span
    offset = like.data_ptr() - a.buffer.data_ptr()
    size = like.element_size()
    base = base[: base.numel() // size * size]
    if offset % size:
        raw = base.as_strided((*like.shape, size), (*(s * size for s in like.stride()), 1), offset)
        return raw.contiguous().view(like.dtype).view(like.shape)
    return base.view(like.dtype).as_strided(like.shape, like.stride(), offset // size)
