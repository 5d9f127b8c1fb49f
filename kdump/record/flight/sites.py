"""CUDA-graph capture sites of the flight recorder.

A call made during stream capture gets its own slot for its capture site (capture id + position
in the capture), pinned outside the ring's rotation: every replay of the graph refreshes it. At
most half the ring's slots are pinned (`Journal.pin`), and the device tier has its own bound; a
site over budget keeps its header only, in a rotating slot. When a site is made, the last eager
call of the same target on the same buffers is pinned too (what the buffers held before
capture).

Capture ids come from `CaptureTracker`: a new id each time a capture begins, seen at the first
call made in it or announced by torch's `CUDAGraph.capture_begin`, which
`report_captures_to` patches (once per process) to tell the active recorder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kdump.record.flight.journal import Journal

Key = tuple[int, int]  # (capture id, position in the capture)
Eager = tuple[int, int, tuple[int, ...]]  # an eager call: (slot, seq, its tensors' addresses)


@dataclass(frozen=True)
class Site:
    """One capture site: a call position inside one stream capture."""

    capture_id: int
    position: int
    slot: int | None  # its pinned slot; None: over budget
    counter: int  # index into the device-side replay counters
    eager_seq: int = 0  # journal seq of the eager call on the same buffers before capture


class CaptureTracker:
    """Capture ids: a new id each time a stream capture begins (seen at the first call made in
    it, or announced by CUDAGraph.capture_begin)."""

    def __init__(self) -> None:
        self.capture_id = 0
        self.position = 0
        self._in_capture = False

    def begin(self) -> None:
        self.capture_id += 1
        self.position = 0
        self._in_capture = True

    def end(self) -> None:
        self._in_capture = False

    def next_site(self, capturing: bool) -> Key | None:
        if not capturing:
            self._in_capture = False
            return None
        if not self._in_capture:
            self.begin()
        pos = self.position
        self.position += 1
        return self.capture_id, pos


def pin_site(
    sites: dict[Key, Site],
    key: Key,
    last: Eager | None,
    tensors: list[Any],
    journal: Journal,
    max_sites: int | None,
) -> Site:
    """The site of `key`, made (and its slot pinned) at its first call; `last`: the target's
    last eager call, pinned too when it was made on the same buffers; `max_sites`: the device
    tier's bound (None: no device tier)."""
    site = sites.get(key)
    if site is not None:
        return site
    counter = len(sites)
    over = max_sites is not None and counter >= max_sites
    slot = None if over else journal.pin_next()
    eager_seq = 0
    if last is not None and last[2] == tuple(t.data_ptr() for t in tensors):
        if journal.pin(last[0]):  # the buffers' values before capture stay
            eager_seq = last[1]
    site = Site(key[0], key[1], slot, counter, eager_seq)
    sites[key] = site
    return site


class CaptureListener(Protocol):
    """What torch's patched graph capture tells the active recorder."""

    def capture_begins(self) -> None: ...

    def capture_ends(self) -> None: ...


class _Active:
    recorder: CaptureListener | None = None  # whose captures torch's patched graph reports


def report_captures_to(rec: CaptureListener) -> None:
    """Make `rec` the recorder torch's graph captures are reported to (patching
    `torch.cuda.CUDAGraph` the first time)."""
    _Active.recorder = rec
    _patch_graph_capture()


def stop_reporting_to(rec: CaptureListener) -> None:
    if _Active.recorder is rec:
        _Active.recorder = None


def _patch_graph_capture() -> None:
    """New capture ids exactly where torch begins a capture; the side branch of the host
    copies joined back into the capture before it ends."""
    import torch

    cls = torch.cuda.CUDAGraph
    if getattr(cls, "_kdump_patched", False):
        return
    begin, end = cls.capture_begin, cls.capture_end

    def capture_begin(graph: Any, *a: Any, **k: Any) -> Any:
        rec = _Active.recorder
        if rec is not None:
            rec.capture_begins()
        return begin(graph, *a, **k)

    def capture_end(graph: Any, *a: Any, **k: Any) -> Any:
        rec = _Active.recorder
        if rec is not None:
            rec.capture_ends()
        return end(graph, *a, **k)

    cls.capture_begin, cls.capture_end = capture_begin, capture_end
    cls._kdump_patched = True
