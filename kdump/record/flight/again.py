"""The flight recorder's exact-repeat path: what it keeps of a recorded eager call to record the
next call of the same repeat key (kdump.record.repeat) without the full path.

The slot of such a call is the learned call's with this call's index, time, stream and moving
versions put in: a template of the slot's bytes (`Journal.template`) whose holes are cut where
sentinel values stood, and the copies are the learned call's (the same plan, the same memo of
device copies). `learn` makes the repeat after a full-path call; `RingRecorder._again` uses it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kdump.format.journal import SlotMeta
from kdump.record.flight.journal import Journal, SlotTemplate
from kdump.record.flight.statics import Statics, version_of

if TYPE_CHECKING:
    from kdump.record.flight.layout import Layout

MISS = object()  # `RingRecorder._again`: not a repeat, take the full path
MOVING = object()  # `FlightRepeat.versions`: a version that fills a hole (no fixed value)
# Sentinels cut out of a template's JSON (`Journal.template`): 19 digits, not an address, a size
# or a time a call could carry.
SENTINEL = 7_319_846_250_183_746_000


@dataclass(frozen=True)
class FlightRepeat:
    """A recorded eager call, as the exact-repeat path replays calls of its repeat key: its
    tensors (weak references: a static candidate's must be the same object again; the others
    may be new objects over the same memory), the versions of its static candidates, the slot
    template and what the copies need. A `kdump.record.repeat.Learned`."""

    target: str
    refs: tuple[Any, ...]
    # (tensor index, version) of static candidates, (tensor index, MOVING) of each version
    # that fills a hole; in storage order (the holes' order)
    versions: tuple[tuple[int, Any], ...]
    template: SlotTemplate
    journal: Journal
    devcopies: Any
    statics: Statics | None
    generation: int
    layout: Layout
    ptrs: tuple[int, ...]
    cuda_call: bool
    direct: bool
    plan: Any
    whole: Any
    enqueued: dict[int, Any]  # the device copies' per-slot memo (`DeviceCopies.copy`)
    # tensors that must be the same objects again (those of static candidates: their versions
    # say whether the static copy holds), and each tensor's storage size (recorded in the slot)
    pinned: frozenset[int]
    storage_nbytes: tuple[int, ...]


def learn(
    tensors: list[Any],
    layout: Layout,
    meta: SlotMeta,
    want: list[bool],
    generation: int,
    j: Journal,
    statics: Statics | None,
    devcopies: Any,
    direct: bool,
    device: tuple[Any, Any, bool],
) -> FlightRepeat | None:
    """What `RingRecorder._again` needs to record the next call exactly like this one (None: it
    cannot, e.g. `refer` changed the static region's decisions, so the next call may differ).
    `device`: (plan, whole layout, whether it is a CUDA call)."""
    if statics is not None and statics.generation != generation:
        return None
    candidates = {i for i, _ in layout.candidates.storages}
    # Per-call integers: the call index, the time, the versions of the storages that are
    # not static candidates (outputs, activations: their versions move every call).
    holes: list[int] = []  # in JSON order: storages (versions), then extra
    values: list[int] = []
    moving: set[int] = set()  # storages
    storages = list(meta.storages)
    for i, d in enumerate(storages):
        if "version" in d and i not in candidates:
            holes.append(SENTINEL + 2 + len(moving))  # +0, +1: the index and time
            values.append(d["version"])
            storages[i] = {**d, "version": holes[-1]}
            moving.add(i)
    extra = dict(meta.extra)
    extra["call_index"], extra["time_ns"] = SENTINEL, SENTINEL + 1
    holes += [SENTINEL, SENTINEL + 1]
    values += [meta.call_index, meta.extra["time_ns"]]
    sentinels = replace(meta, storages=storages, extra=extra)
    tpl = j.template(sentinels, want, holes, (meta, values))
    if tpl is None:
        return None
    # Per storage in order (holes are in storage order): its first view, and its version where
    # it must stay (static candidates) or MOVING where it fills a hole.
    versions: list[tuple[int, Any]] = []
    for i, f in enumerate(layout.firsts):
        if i in candidates:
            versions.append((f, version_of(tensors[f])))
        elif i in moving:
            versions.append((f, MOVING))
    plan, whole, cuda = device
    return FlightRepeat(
        meta.target,
        tuple(weakref.ref(t) for t in tensors),
        tuple(versions),
        tpl,
        j,
        devcopies,
        statics,
        statics.generation if statics is not None else -1,
        layout,
        tuple(t.data_ptr() for t in tensors),
        cuda,
        direct,
        plan,
        whole if plan is not None else None,
        {},
        frozenset(k for k, r in enumerate(layout.records) if r.storage in candidates),
        tuple(layout.storages[r.storage].storage_nbytes for r in layout.records),
    )
