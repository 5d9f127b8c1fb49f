"""The routing argument of a call and the shrinking-batch sequence derived from it.

A serving loop captures its graph at one batch and replays it while the batch shrinks: fewer
valid rows per group than at capture, down to none. The graph chain's shrinking-batch step
replays that, in one process, so it must know which argument is the routing and how to read it.
It comes from the kernel's spec (its `touches` rule: DeepGEMM's labels, psum and masked layouts)
or, for a kernel without one, from `--routing NAME:LAYOUT` (kdump.replay.options.parse_routing).

Layouts, by the name used here:

- labels: an integer tensor of any shape, one entry per row in row-major order; an entry >= 0 is
  the group of a valid row, a negative entry marks an invalid row. Shrinking keeps each group's
  first rows (in row order) and sets the others to -1, so a group's valid rows stay a prefix of
  the rows it had (DeepGEMM's tiles keep their group).
- counts: an integer tensor of any shape, one entry per group: its valid rows (masked_m).
  Shrinking lowers each entry to the cap.
- psum (spec only): a 1-D tensor of cumulative end rows; group g occupies
  [align(end[g-1], A), end[g]) with A the spec's alignment, group 0 starting at row 0. Shrinking
  keeps each group's first rows and recomputes the ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kdump.kernels.plugin import KernelSpec, Role

# A spec's touch rule -> the layout name used here.
_FROM_TOUCH = {"labels": "labels", "masked": "counts", "psum": "psum"}


@dataclass(frozen=True)
class RoutingArg:
    """Which argument routes the call's rows, and how to read it."""

    name: str
    layout: str  # labels | counts | psum
    alignment: int = 1  # psum: where each group starts
    source: str = "the kernel's spec"  # or "--routing"

    def describe(self) -> str:
        return f"{self.name} ({self.layout} layout, from {self.source})"


def find_routing(
    spec: KernelSpec, bound: Mapping[str, Any], option: tuple[str, str] | None
) -> RoutingArg | str:
    """The call's routing argument, or one line saying why none is known. `option`: the
    (name, layout) of `--routing`, which wins over the spec."""
    if option is not None:
        name, layout = option
        arg = RoutingArg(name, layout, 1, "--routing")
    else:
        arg_or_why = _from_spec(spec, bound)
        if isinstance(arg_or_why, str):
            return arg_or_why
        arg = arg_or_why
    if arg.name not in bound:
        known = ", ".join(sorted(bound)) or "none"
        return f"{arg.source}: the call has no argument {arg.name!r} (its arguments: {known})"
    value = bound[arg.name]
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
        what = (
            f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        )
        return f"routing argument {arg.name} is {what}, not an integer tensor"
    if value.dtype == torch.bool:
        return f"routing argument {arg.name} is a bool tensor, not an integer tensor"
    if arg.layout == "labels" and not value.dtype.is_signed:
        # -1 marks an invalid row: an unsigned tensor would wrap it into a valid label
        return f"routing argument {arg.name} is {value.dtype}: labels need a signed integer type"
    if arg.layout == "psum" and value.dim() != 1:
        return f"routing argument {arg.name}: a psum layout is 1-D, not {list(value.shape)}"
    return arg


def _from_spec(spec: KernelSpec, bound: Mapping[str, Any]) -> RoutingArg | str:
    for touch in spec.touches(bound):
        layout = _FROM_TOUCH.get(touch.rule)
        if layout is not None and touch.by:
            return RoutingArg(touch.by, layout, max(1, int(touch.alignment)))
    named = spec.names_with_role(Role.ROUTING)
    if named:
        first = named[0]
        return (
            f"the spec names routing argument(s) {', '.join(named)} in a layout kdump does not "
            f"know; name one with --routing {first}:labels or --routing {first}:counts"
        )
    return (
        "no routing known for this kernel; name its routing argument with --routing NAME:labels "
        "(a row's group, -1 = invalid row) or --routing NAME:counts (valid rows per group)"
    )


# --- reading a layout ---------------------------------------------------------------------------


def group_counts(arg: RoutingArg, values: torch.Tensor) -> list[int]:
    """Valid rows of each group (labels: of each label that occurs; counts and psum: of each
    entry)."""
    v = values.detach().reshape(-1).to("cpu", torch.int64)
    if arg.layout == "labels":  # by distinct label: a bundle's labels may be any size
        return torch.unique(v[v >= 0], return_counts=True)[1].tolist()
    if arg.layout == "counts":
        return v.clamp(min=0).tolist()
    return [e - s for s, e in _psum_bounds(v.tolist(), arg.alignment)]


def valid_rows(arg: RoutingArg, values: torch.Tensor) -> int:
    return sum(group_counts(arg, values))


def _psum_bounds(ends: list[int], alignment: int) -> list[tuple[int, int]]:
    """(start, end) of each psum group; an end before its start counts as an empty group."""
    out, prev = [], 0
    for g, end in enumerate(ends):
        start = 0 if g == 0 else _align(prev, alignment)
        end = max(end, start)
        out.append((start, end))
        prev = end
    return out


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# --- shrinking ----------------------------------------------------------------------------------


def shrink_caps(most: int) -> list[int]:
    """Rows per group to keep, in order, below `most` (the fullest group at capture): one row
    fewer, halving with an odd three-eighths between, then a single row and none. 32 gives
    31, 16, 12, 8, 1, 0."""
    wanted = {most - 1, most // 2, (3 * most) // 8, most // 4, 1, 0}
    return sorted((c for c in wanted if 0 <= c < most), reverse=True)


def shrink(arg: RoutingArg, values: torch.Tensor, cap: int) -> torch.Tensor:
    """`values` with at most `cap` valid rows per group: same shape, dtype and device."""
    v = values.detach().to("cpu", torch.int64)
    flat = v.reshape(-1)
    if arg.layout == "labels":
        out = flat.clone()
        out[(flat >= 0) & (_rank_in_group(flat) >= cap)] = -1
    elif arg.layout == "counts":
        out = torch.where(flat > cap, torch.full_like(flat, cap), flat)
    else:
        out = torch.tensor(_psum_ends(flat.tolist(), arg.alignment, cap), dtype=torch.int64)
    return out.reshape(values.shape).to(device=values.device, dtype=values.dtype)


def _rank_in_group(labels: torch.Tensor) -> torch.Tensor:
    """Each entry's position among the entries with the same label, in row order."""
    order = torch.sort(labels, stable=True).indices
    sorted_labels = labels[order]
    _, counts = torch.unique_consecutive(sorted_labels, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(labels.numel()) - torch.repeat_interleave(starts, counts)
    rank = torch.empty_like(labels)
    rank[order] = pos
    return rank


def _psum_ends(ends: list[int], alignment: int, cap: int) -> list[int]:
    out, prev = [], 0
    for g, (start, end) in enumerate(_psum_bounds(ends, alignment)):
        begin = 0 if g == 0 else _align(prev, alignment)
        prev = begin + min(end - start, cap)
        out.append(prev)
    return out


@dataclass(frozen=True)
class ShrinkStep:
    """One replay of the shrinking-batch sequence: its name, the routing to write in place, and
    what to say about it."""

    name: str
    values: dict[str, torch.Tensor]
    message: str
    metrics: dict[str, int]


def shrinking_sequence(
    arg: RoutingArg,
    values: torch.Tensor,
    validate: Callable[[torch.Tensor], list[str]],
) -> tuple[list[ShrinkStep], list[str]]:
    """The sequence's replays for the recorded routing `values`, and notes (caps left out because
    the routing they give breaks the kernel's contract: `validate` returns the violations of a
    candidate). An empty sequence comes with a note saying why."""
    counts = group_counts(arg, values)
    most = max(counts, default=0)
    captured = sum(counts)
    if most == 0:
        return [], [f"{arg.name} has no valid rows at capture: there is nothing to shrink"]
    steps: list[ShrinkStep] = []
    notes: list[str] = []
    for cap in shrink_caps(most):
        candidate = shrink(arg, values, cap)
        broken = validate(candidate)
        if broken:
            notes.append(
                f"shrinking batch: {_rows(cap)} per group left out, its routing breaks the "
                f"kernel's contract ({'; '.join(broken[:2])})"
            )
            continue
        kept = valid_rows(arg, candidate)
        steps.append(
            ShrinkStep(
                f"shrinking batch {len(steps) + 1} ({_rows(cap)} per group)",
                {arg.name: candidate},
                f"{arg.name} keeps at most {_rows(cap)} of {most} per group: {_rows(kept)} in "
                f"all, {captured} at capture",
                {"rows_per_group": cap, "valid_rows": kept, "captured_rows": captured},
            )
        )
    return steps, notes


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"
