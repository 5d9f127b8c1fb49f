"""Poisoned halos and guard regions around every materialised storage.

compute-sanitizer before its 2026.2 release does not see TMA loads past an allocation, so kdump
places each storage inside a larger allocation whose halo before and after holds a sentinel: NaN
encodings (all-ones bytes) for float and FP8 storages, a marked pattern (0x7F bytes: a huge
positive value, an impossible label) for integers. An out-of-bounds read shows as NaN or garbage in
outputs; an out-of-bounds write changes a halo byte, which `check` names by argument and offset.

A second poison (`variant` 1: 0x4B bytes, finite in every float format: 1.3e7 in float32 and
bfloat16, 14.6 in float16, 5.5 / 14 in FP8; 0x40 for integers) lets the replay run the call
again with other halo bytes: output elements that follow the change read a halo
(kdump.replay.overreads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kdump.bundle.materialize import Allocation
from kdump.format.dtypes import dtype_from_name
from kdump.format.records import TensorRecord

FLOAT_FILL = 0xFF
INT_FILL = 0x7F
# The second poison of the differential: finite in float32/16, bfloat16 and both FP8 formats.
FLOAT_FILL_B = 0x4B
INT_FILL_B = 0x40


def fill_byte(tensors: Sequence[TensorRecord], storage: int, variant: int = 0) -> int:
    floating = True
    for rec in tensors:
        if rec.storage == storage:
            floating = dtype_from_name(rec.dtype).is_floating_point
            break
    if variant:
        return FLOAT_FILL_B if floating else INT_FILL_B
    return FLOAT_FILL if floating else INT_FILL


def fill(
    allocations: Sequence[Allocation], tensors: Sequence[TensorRecord], variant: int = 0
) -> None:
    """Every halo with poison `variant` (0: NaN / 0x7F, the default; 1: the second poison)."""
    for a in allocations:
        byte = fill_byte(tensors, a.storage, variant)
        a.buffer[: a.span_offset].fill_(byte)
        a.buffer[a.span_offset + a.span_nbytes :].fill_(byte)


def fill_beyond(a: Allocation, side: str, nbytes: int, byte: int) -> None:
    """Fill the halo bytes on `side` that lie more than `nbytes` from the span (the nearest
    `nbytes` keep what they hold)."""
    if side == "before":
        a.buffer[: max(0, a.span_offset - nbytes)].fill_(byte)
    else:
        a.buffer[a.span_offset + a.span_nbytes + nbytes :].fill_(byte)


@dataclass(frozen=True)
class HaloSnapshot:
    before: list[torch.Tensor]
    after: list[torch.Tensor]


def snapshot(allocations: Sequence[Allocation]) -> HaloSnapshot:
    return HaloSnapshot(
        [a.buffer[: a.span_offset].clone() for a in allocations],
        [a.buffer[a.span_offset + a.span_nbytes :].clone() for a in allocations],
    )


@dataclass(frozen=True)
class HaloViolation:
    storage: int
    names: tuple[str, ...]
    side: str  # "before" | "after"
    offset: int  # bytes from the span's first byte (negative before it) or past its end
    changed: int  # number of changed bytes

    def describe(self) -> str:
        """Where stray bytes landed. The guard names the victim, not the writer: a kernel that
        writes far past its own output can land in the guard of any allocation."""
        who = " / ".join(self.names) or f"storage {self.storage}"
        if self.side == "after":
            where = f"the guard after {who} (first {self.offset} bytes past its end)"
        else:
            where = f"the guard before {who} (first {-self.offset} bytes before its start)"
        return f"stray write: {self.changed} byte(s) changed in {where}"


def check(
    allocations: Sequence[Allocation],
    saved: HaloSnapshot,
    tensors: Sequence[TensorRecord],
    names: Sequence[str],
) -> list[HaloViolation]:
    """Halo bytes that changed since `saved` (out-of-bounds writes)."""
    out = []
    for a, before, after in zip(allocations, saved.before, saved.after):
        who = tuple(n for n, rec in zip(names, tensors) if rec.storage == a.storage)
        now_before = a.buffer[: a.span_offset]
        diff = (now_before != before).nonzero()
        if diff.numel():
            # The byte nearest the span is the most telling.
            first = int(diff[-1, 0])
            out.append(
                HaloViolation(a.storage, who, "before", first - a.span_offset, int(diff.shape[0]))
            )
        now_after = a.buffer[a.span_offset + a.span_nbytes :]
        diff = (now_after != after).nonzero()
        if diff.numel():
            out.append(HaloViolation(a.storage, who, "after", int(diff[0, 0]), int(diff.shape[0])))
    # Writes running past an end are the common bug: report those first, nearest first.
    return sorted(out, key=lambda v: (v.side != "after", abs(v.offset)))


def halo_bytes(a: Allocation, side: str) -> int:
    return a.span_offset if side == "before" else a.buffer.numel() - a.span_offset - a.span_nbytes
