"""DeepGEMM's routing metadata read from a recorded call: per-group summaries (the report's
tables and plot, `kdump diff`) and the rows and groups a call reads (slim).

Layouts of the m-grouped GEMMs:
- labels: `grouped_layout` int32 [M], the group of each row, -1 for padding rows;
- psum: `grouped_layout` int32 [G] of cumulative end rows (`use_psum_layout=True`); group g
  occupies rows [align(end[g-1], A), end[g]) with A the mk alignment, group 0 starts at row 0;
- masked: `masked_m` int32 [G], the valid rows of each group's [max_m] block.
"""

from __future__ import annotations

from collections import Counter

import torch

from kdump.kernels.deepgemm.reference import psum_row_mask
from kdump.kernels.deepgemm.scales import align
from kdump.kernels.plugin import RecordedArgs, RoutingSummary, RowsUsed, summarize_histogram


def _dim(args: RecordedArgs, name: str, dim: int) -> int | None:
    shape = args.shape(name)
    return shape[dim] if shape is not None and len(shape) > dim else None


def summarize(name: str, values: list[int], args: RecordedArgs, alignment: int) -> RoutingSummary:
    """`values` of the routing argument `name` per group, in the layout the call gives it; a
    histogram when the layout cannot be told (no B to count the groups of)."""
    groups = _dim(args, "b", 0)
    if name == "masked_m":
        return summarize_masked(name, values, _dim(args, "a", 1))
    if name == "grouped_layout" and args.value("use_psum_layout") is True:
        return summarize_psum(name, values, alignment)
    if name == "grouped_layout" and groups is not None:
        return summarize_labels(name, values, groups)
    return summarize_histogram(name, values)


def summarize_labels(name: str, labels: list[int], groups: int) -> RoutingSummary:
    tally = Counter(labels)
    counts = tuple(tally.get(g, 0) for g in range(groups))
    padding = tally.get(-1, 0)
    return RoutingSummary(
        name,
        "labels",
        tuple(range(groups)),
        counts,
        padding=padding,
        invalid=len(labels) - padding - sum(counts),
        rows=len(labels),
    )


def summarize_psum(name: str, ends: list[int], alignment: int) -> RoutingSummary:
    counts, padding, invalid, prev_end = [], 0, 0, 0
    for g, end in enumerate(ends):
        start = 0 if g == 0 else align(prev_end, alignment)
        if end < start:
            invalid += 1
        counts.append(max(0, end - start))
        padding += start - prev_end if g else 0
        prev_end = max(end, start)
    return RoutingSummary(
        name,
        "psum",
        tuple(range(len(ends))),
        tuple(counts),
        padding=padding,
        invalid=invalid,
        rows=ends[-1] if ends else 0,
    )


def summarize_masked(name: str, masked_m: list[int], max_m: int | None) -> RoutingSummary:
    invalid = sum(1 for m in masked_m if m < 0 or (max_m is not None and m > max_m))
    return RoutingSummary(
        name,
        "masked",
        tuple(range(len(masked_m))),
        tuple(max(0, m) for m in masked_m),
        padding=None if max_m is None else sum(max_m - min(max(m, 0), max_m) for m in masked_m),
        invalid=invalid,
        rows=None if max_m is None else max_m * len(masked_m),
    )


def rows_used(args: RecordedArgs, alignment: int) -> RowsUsed | None:
    """The rows of A and the groups of B the call reads: rows of groups with tokens (labels
    >= 0, inside a psum group, below masked_m) and the groups that have any."""
    b = args.shape("b")
    if b is None:
        return None
    g = b[0] if b else 0
    a = args.shape("a")
    counts = args.read("masked_m")
    if counts is not None:
        counts = counts.reshape(-1).long()
        if len(counts) != g or a is None or len(a) < 2:
            return None
        max_m = a[1]
        rows = torch.arange(max_m).unsqueeze(0) < counts.clamp(0, max_m).unsqueeze(1)
        return RowsUsed(rows, counts > 0)
    layout = args.read("grouped_layout")
    if layout is None:
        return None
    layout = layout.reshape(-1).long()
    if args.value("use_psum_layout") is True:
        if not a:
            return None
        rows = psum_row_mask(layout, alignment, a[0])
        ends = layout.tolist()
        used = []
        for k, end in enumerate(ends):
            start = 0 if k == 0 else -(-ends[k - 1] // alignment) * alignment
            used.append(end > start)
        return RowsUsed(rows, torch.tensor(used + [False] * max(0, g - len(used)))[:g])
    rows = (layout >= 0) & (layout < g)
    groups = torch.zeros(g, dtype=torch.bool)
    groups[layout[rows]] = True
    return RowsUsed(rows, groups)
