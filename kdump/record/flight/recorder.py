"""The flight recorder (`mode="ring"`): the last calls of a process in a crash-proof journal.

Per recorded call the host writes a compact header into the next journal slot (call index,
target, argument tree and layouts, stream, capture and graph ids) and the call's small arguments
are copied into the slot before the kernel runs: by the host for CPU tensors, asynchronously on
the call's own stream for CUDA tensors (the journal is pinned shared memory), with the slot's
markers ordered around them (kdump.record.flight.journal). Nothing synchronises on the hot path.

What is copied, in priority order while the slot has room: arguments whose spec role is routing,
scalar or hint, inputs no bigger than `SMALL_BYTES`, then the other inputs, smallest first; what
does not fit (weights, big activations) keeps its layout only (salvage marks it missing).

Outputs (`--outputs`; by default every tensor argument of a target whose spec has no reference,
none for one that has) are copied again AFTER the call, on its stream, into the slot's room
left after the inputs, smallest first (`_outputs_fit`); under CUDA-graph capture those copies
are captured after the kernel, so every replay refreshes them. Their bytes from before the call
are the inputs' (kept where they fit); outputs that do not fit are named in the slot's
`extra["outputs_not_kept"]` with the slot size that would hold them.

CUDA graphs: a call made during stream capture gets its own slot for its capture site (capture
id + position in the capture), pinned outside the ring's rotation; its copies are captured into
the graph, together with an `add_` on a device-side counter that the graph copies into the
slot's markers, so every replay refreshes the slot before the kernel; with the snapshot kernel
the next snapshot of the site's chain (kdump.record.flight.devcopy) marks it done.
At most half the ring's slots are pinned (`Journal.pin`); a site over that budget keeps its
header only, in a rotating slot, marked `site_over_budget`. When a site is made, the last eager
call of the same target on the same buffers is pinned too (what the buffers held before
capture).

The journal is allocated at the first recorded call: for CUDA calls only outside capture (never
during it), on the device current then; a process that never makes a recorded call (launchers,
tokenizers) never allocates one.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdump import config
from kdump.format.journal import SlotMeta, SlotTooSmall
from kdump.log import log_once
from kdump.record.flight.journal import Journal, Slot, SlotTemplate
from kdump.record.flight.salvage import CRASH_SUFFIX, raised_path
from kdump.record.flight.statics import (
    Candidates,
    Statics,
    first_views,
    lazy_bits,
    storage_meta,
    version_of,
)
from kdump.record.hooks import HookState, busy

if TYPE_CHECKING:
    from kdump.record.config import RecordConfig
    from kdump.record.flight.devcopy import DeviceCopies
    from kdump.record.session import Recording

_ACTIVE: RingRecorder | None = None  # the recorder whose captures torch's patched graph reports
# Journals and device tiers of closed recorders that captured graphs: kept for
# the life of the process, since those graphs write into them at every replay.
_RETIRED: list[tuple[Any, Any]] = []

SMALL_BYTES = 64 << 10  # inputs up to this size are copied whatever their role
_NO_OUTPUTS: list[Any] = []  # shared, never changed
SLOT_SHARE = 0.9  # of a slot, what payloads may take (the rest: header and argument JSON)
COPIED_ROLES = ("routing", "scalar", "hint")


@dataclass(frozen=True)
class Site:
    """One capture site: a call position inside one stream capture."""

    capture_id: int
    position: int
    slot: int | None  # its pinned slot; None: over budget
    counter: int  # index into the device-side replay counters
    eager_seq: int = 0  # journal seq of the eager call on the same buffers before capture


class _CaptureTracker:
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

    def next_site(self, capturing: bool) -> tuple[int, int] | None:
        if not capturing:
            self._in_capture = False
            return None
        if not self._in_capture:
            self.begin()
        pos = self.position
        self.position += 1
        return self.capture_id, pos


class RingRecorder:
    """The Recorder of mode ring (see the module docstring)."""

    mode = "ring"

    def __init__(self, cfg: RecordConfig, session: Recording) -> None:
        self.cfg = cfg
        self.session = session
        self._init_process()

    def _init_process(self) -> None:
        self.lock = threading.RLock()
        self._reserved = threading.local()  # this thread's current call: (slot, seq)
        self._raised: dict[int, str] = {}  # slot -> the note of its call that raised
        self.journal: Journal | None = None
        self.pid = os.getpid()
        self.errors = 0
        self.written: list[Path] = []
        self._flushed: dict[Path, Any] = {}  # what each flush wrote: unchanged slots are kept
        self.captures = _CaptureTracker()
        self.sites: dict[tuple[int, int], Site] = {}
        self._last_eager: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._target_ids: dict[str, int] = {}
        self._calls = itertools.count()
        self._cuda: DeviceCopies | None = None
        self._plans: dict[Any, Any] = {}
        self._layouts: dict[Any, _Layout] = {}
        # per repeat key (`_repeat_key`): `_again`; least recently used first
        self._repeats: OrderedDict[Any, _Repeat] = OrderedDict()
        self._lanes: dict[Any, _Lane] = {}  # `_probe` -> the repeat its arguments took last
        self._sightings: dict[int, None] = {}  # hashes of repeat keys seen once, no template
        self.fast_calls = 0  # calls recorded by the exact-repeat path (`_again`)
        self.too_big = 0  # calls whose metadata did not fit a slot (not recorded)
        self._hooks_installed = False
        self.statics: Statics | None = None  # made with the journal (kdump.record.flight.statics)

    def after_fork(self) -> None:
        # The parent's journal and its mapping belong to the parent; the child starts its own.
        self._init_process()

    # -- the journal ------------------------------------------------------------------------------
    def _open(self, cuda_device: Any = None) -> Journal:
        if self.journal is None:
            ring = self.cfg.ring
            ring.journal_dir.mkdir(parents=True, exist_ok=True)
            self.journal = Journal.create(
                ring.journal_dir,
                slots=ring.slots,
                slot_bytes=ring.slot_bytes,
                process_info=process_block(),
            )
            self._install_last_words()
        if cuda_device is not None and self._cuda is None:
            from kdump.record.flight.devcopy import DeviceCopies

            self._cuda = DeviceCopies(self.journal, cuda_device, self.cfg.ring.device_bytes)
            global _ACTIVE
            _ACTIVE = self
            self._patch_graph_capture()
        return self.journal

    def _install_last_words(self) -> None:
        if self._hooks_installed:
            return
        self._hooks_installed = True
        previous = sys.excepthook

        def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
            try:
                self.note_crash(kind, exc, tb)
            except Exception:
                pass
            previous(kind, exc, tb)

        sys.excepthook = hook

    def note_crash(self, kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        """Write the Python traceback (and the CUDA error, when it is one) next to the journal:
        salvage puts them in the crash context."""
        j = self.journal
        if j is None:
            return
        text = "".join(traceback.format_exception(kind, exc, tb))[-8000:]
        doc: dict[str, Any] = {"traceback": text, "exception": f"{kind.__name__}: {exc}"[:2000]}
        if "CUDA" in str(exc) or "cuda" in kind.__name__.lower():
            doc["cuda_error"] = str(exc)[:2000]
        tmp = j.path.with_name(j.path.name + CRASH_SUFFIX + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, j.path.with_name(j.path.name + CRASH_SUFFIX))

    def _note_raised(self, reserved: tuple[int, int], index: int, exc: BaseException) -> None:
        """A recorded call raised (the program may catch it and go on): a note next to the
        journal, so its bundle says the call raised instead of "the kernel had not finished".
        Only the newest notes are kept, one per slot at most: a program that raises at every
        call must not fill /dev/shm."""
        j = self.journal
        if j is None:
            return
        doc = {
            "slot": reserved[0],
            "seq": reserved[1],
            "call_index": index,
            "exception": f"{type(exc).__name__}: {exc}"[:2000],
        }
        with self.lock:
            notes = self._raised
            notes.pop(reserved[0], None)
            notes[reserved[0]] = json.dumps(doc)  # a slot's older note: its call is gone
            text = "".join(line + "\n" for line in notes.values())
            path = raised_path(j.path)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)  # whole or not at all, whenever the process dies

    def _patch_graph_capture(self) -> None:
        """New capture ids exactly where torch begins a capture; the side branch of the host
        copies joined back into the capture before it ends."""
        import torch

        cls = torch.cuda.CUDAGraph
        if getattr(cls, "_kdump_patched", False):
            return
        begin, end = cls.capture_begin, cls.capture_end

        def capture_begin(graph: Any, *a: Any, **k: Any) -> Any:
            rec = _ACTIVE
            if rec is not None:
                rec.captures.begin()
                if rec._cuda is not None:  # queued eager host copies: never into the graph
                    with rec.lock:
                        rec._cuda.drain()
            return begin(graph, *a, **k)

        def capture_end(graph: Any, *a: Any, **k: Any) -> Any:
            rec = _ACTIVE
            if rec is not None:
                rec.captures.end()
                if rec._cuda is not None:
                    try:
                        rec._cuda.join_capture()
                    except Exception as exc:
                        log_once("ringjoin", f"flight recorder: joining its copy branch: {exc}")
            return end(graph, *a, **k)

        cls.capture_begin, cls.capture_end = capture_begin, capture_end
        cls._kdump_patched = True

    # -- the call ---------------------------------------------------------------------------------
    def on_call(
        self,
        st: HookState,
        index: int,
        called_as: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        prev = busy.flag
        busy.flag = True  # hooked calls made inside this one pass through unrecorded
        try:
            after = None
            self._reserved.slot = None
            try:
                if self.session.trigger(st.id).select(index, args, kwargs):
                    after = self._before(st, index, called_as, args, kwargs)
            except SlotTooSmall as exc:  # this call only: the target's next calls still record
                self.too_big += 1
                log_once(
                    f"slotsize:{st.id}", f"flight recorder: a call of {st.id} not recorded ({exc})"
                )
            except Exception as exc:
                self.session.fail(st, "recording the call into the flight recorder", exc)
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # the slot stays not done; the bundle says why
                reserved = self._reserved.slot
                if after is not None and reserved is not None:
                    try:
                        self._note_raised(reserved, index, exc)
                    except Exception as why:
                        self.session.fail(st, "noting the call's exception", why)
                raise
            if after is not None:
                try:
                    after()
                except Exception as exc:
                    self.session.fail(st, "marking the call done in the flight recorder", exc)
            return result
        finally:
            busy.flag = prev

    def _before(
        self,
        st: HookState,
        index: int,
        called_as: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Callable[[], None] | None:
        probe = lane = tensors = None
        try:
            probe = _probe(st.id, called_as, args, kwargs)
            lane = self._lanes.get(probe)
            if lane is not None:
                tensors = lane.tensors(args, kwargs)
        except Exception as exc:  # the repeat path is an optimisation: never a failed call
            log_once(f"repeatlane:{self.pid}", f"flight recorder: no lane ({exc!r})")
        if lane is not None and tensors is not None:
            done = self._again(lane.rep, index, tensors, same=True)
            if done is not _MISS:
                return done  # type: ignore[return-value]
        try:
            seen = _repeat_key(st.id, called_as, args, kwargs)
        except Exception as exc:
            log_once(f"repeatkey:{self.pid}", f"flight recorder: no repeat path ({exc!r})")
            seen = None
        if seen is not None:
            rep = self._repeats.get(seen[0])
            if rep is not None:
                with contextlib.suppress(KeyError):  # another thread may have evicted it
                    self._repeats.move_to_end(seen[0])
                done = self._again(rep, index, seen[1])
                if done is not _MISS:
                    lane = _Lane.of(rep, args, kwargs, seen)
                    if lane is not None and probe is not None:
                        if len(self._lanes) >= 4 * _REPEATS_MAX:
                            self._lanes.clear()
                        self._lanes[probe] = lane
                    return done  # type: ignore[return-value]
        import torch

        from kdump.bundle import argtree
        from kdump.bundle.tensors import group_storages

        with torch._C.DisableTorchFunctionSubclass():
            tensors: list[Any] = []
            args_tree = [argtree.encode(a, tensors) for a in args]
            kwargs_tree = {str(k): argtree.encode(v, tensors) for k, v in kwargs.items()}
            cuda = [t for t in tensors if t.is_cuda]
            capturing = self._is_capturing(cuda)
            with self.lock:
                if cuda and self.journal is None and capturing:
                    return None  # never allocate during capture
                j = self._open(cuda[0].device if cuda and not capturing else None)
                if cuda and self._cuda is None:
                    return None  # the journal was made by CPU calls; CUDA side needs no capture
                key = _signature(st.id, tensors, args_tree, kwargs_tree)
                cached = self._layouts.get(key)
                if cached is None:
                    storages, records = group_storages(tensors)
                    roles = _tensor_roles(st, args, kwargs, tensors)
                    names = st.names()
                    outs = self._output_storages(st, args, kwargs, tensors, records, storages)
                    want, kept, not_kept = self._wanted(
                        st, args, kwargs, tensors, records, storages, roles, outs
                    )
                    if not_kept is not None:
                        not_kept["tensors"] = _paths(names, args_tree, kwargs_tree, not_kept)
                    cached = _Layout(
                        storages,
                        records,
                        tuple(want),
                        [_storage_dict(s) for s in storages],
                        [_tensor_dict(r) for r in records],
                        (args_tree, kwargs_tree),
                        list(names[: len(args)]) if names and len(names) >= len(args) else None,
                        roles,
                        first_views(records, len(storages)),
                        kept,
                        not_kept,
                    )
                    if len(self._layouts) > 256:
                        self._layouts.clear()
                    self._layouts[key] = cached
                storages, records = cached.storages, cached.records
                want = list(cached.want)
                # Static operands (weights): copied once per (storage, version) into the static
                # region, or recorded by reference; never into the slot. Per call: versions move.
                generation = self.statics.generation if self.statics is not None else -1
                refs = self._static_refs(tensors, records, storages, cached, capturing)
                for i, ref in enumerate(refs):
                    if ref is not None:
                        want[i] = False
                storage_dicts = cached.storage_dicts
                lazy = lazy_bits(tensors, records, len(refs), cached.firsts)
                if any(r is not None for r in refs) or any(lazy):
                    storage_dicts = cached.storage_meta(tensors, records, refs, lazy)
                # equal by the key; the cached objects let the journal reuse their JSON
                args_tree, kwargs_tree = cached.trees
                site_key = self.captures.next_site(capturing)
                stream = 0
                if cuda:
                    from kdump.record.flight.devcopy import current_stream

                    stream = current_stream(torch.cuda.current_device())
                extra: dict[str, Any] = {
                    "call_index": index,
                    "pid": self.pid,
                    "time_ns": time.time_ns(),
                    "mode": "ring",
                    "capturing": capturing,
                    "tiers": ["host"],  # bulky arguments beyond the slot keep their layouts only
                }
                outputs = cached.outs
                if cached.not_kept is not None:
                    extra["outputs_not_kept"] = cached.not_kept
                plan = rule = whole = None
                # One device tier per process, on the device of its first call; a call on another
                # device takes the plain per-payload copies.
                direct = (
                    bool(cuda) and self._cuda is not None and cuda[0].device != self._cuda.device
                )
                if cuda and self._cuda is not None and not direct:
                    plan, rule = self._plan(st, args, kwargs, key, tensors)
                    if plan is not None:
                        plan, rule = self._fit_plan(plan, rule, records, storages)
                    whole = None
                    if plan is not None and self._cuda.kernel is None:
                        whole = self._cuda.whole_layout(plan, storages)
                        if whole is None:
                            plan = rule = None
                    if plan is not None:
                        for i in plan.storages:
                            want[i] = False  # their touched rows go to the device ring
                    extra["tiers"] = self._cuda.tiers(plan is not None)
                    extra["device"] = self._cuda.facts()
                    if whole is not None:
                        extra["device"]["whole"] = whole  # copied whole: no row rule applied
                    if plan is not None:
                        extra["device"]["plan"] = cached.plan_json(plan)
                        # the device ring's depth for this call: worst case, every row touched
                        ring_bytes = extra["device"]["ring_bytes"]
                        extra["device"]["ring_slots_worst_case"] = ring_bytes // plan.worst
                site = None
                pin_index = None
                if site_key is not None:
                    site = self._site(site_key, st.id, tensors)
                    extra["site"] = {
                        "capture": site.capture_id,
                        "position": site.position,
                        "eager_seq": site.eager_seq,
                    }
                    if site.slot is None:
                        extra["site_over_budget"] = True
                        want = [False] * len(storages)
                        outputs = []
                        plan = None
                        extra.get("device", {}).pop("plan", None)
                        extra.get("device", {}).pop("whole", None)
                    pin_index = site.slot
                meta = SlotMeta(
                    call_index=index,
                    target=st.id,
                    target_id=self._target_ids.setdefault(st.id, len(self._target_ids) + 1),
                    called_as=called_as,
                    names=cached.names,
                    args=args_tree,
                    kwargs=kwargs_tree,
                    storages=storage_dicts,
                    tensors=cached.tensor_dicts,
                    stream=stream,
                    capture_id=site.capture_id if site else 0,
                    graph_id=site.capture_id if site else 0,
                    extra=extra,
                    outputs=outputs,
                )
                slot = j.reserve(meta, index=pin_index, want=want)
                self._reserved.slot = (slot.index, slot.seq)
                views = SpanViews(tensors, cached.firsts, storages)
                if seen is not None and site is None and not capturing:
                    try:
                        self._note_repeat(
                            seen, tensors, cached, meta, want, generation, j, direct,
                            (plan, whole, bool(cuda)),
                        )  # fmt: skip
                    except Exception as exc:  # the call is reserved: it must still be recorded
                        self._repeats.pop(seen[0], None)
                        self._lanes.clear()
                        log_once(
                            f"repeatnote:{self.pid}",
                            f"flight recorder: no repeat template ({type(exc).__name__}: {exc})",
                        )
                if site is None:
                    ptrs = tuple(t.data_ptr() for t in tensors)
                    self._last_eager[st.id] = (slot.index, slot.seq, ptrs)
                if not cuda:
                    return self._host_copy(slot, views, outputs)
                if site is not None and site.slot is None:
                    # Over budget: the header only, written now. No captured copies: the slot
                    # rotates, and replays must never write into a later call's slot.
                    slot.commit()
                    slot.finish()
                    return None
                assert self._cuda is not None
                counter = site.counter if site is not None else None
                if direct:
                    after = self._cuda.direct(slot, views, counter)
                else:
                    after = self._cuda.copy(
                        slot,
                        views,
                        counter,
                        plan,
                        rule,
                        index,
                        capturing,
                        whole if plan else None,
                        site.capture_id if site is not None else 0,
                    )
                return self._then_outputs(after, slot, views, outputs, counter, direct)

    def _note_repeat(
        self,
        seen: tuple[Any, list[Any]],
        tensors: list[Any],
        cached: _Layout,
        meta: SlotMeta,
        want: list[bool],
        generation: int,
        j: Journal,
        direct: bool,
        device: tuple[Any, Any, bool],
    ) -> None:
        """After a full-path eager call: the second time its repeat key is seen (or when its
        template stopped matching), keep what `_again` needs; the first time only note the key
        (a call that never repeats pays nothing for templates)."""
        key = seen[0]
        # Sightings keep only the key's hash: a collision costs one template attempt, and a
        # template is used only for its own exact key.
        h = hash(key)
        if h not in self._sightings and key not in self._repeats:
            if len(self._sightings) > 4 * _REPEATS_MAX:
                self._sightings.clear()
            self._sightings[h] = None
            return
        rep = None
        if len(seen[1]) == len(tensors) and all(a is b for a, b in zip(seen[1], tensors)):
            rep = self._remember(tensors, cached, meta, want, generation, j, direct, device)
        self._lanes.clear()  # a lane leads to the template a key had: it may be gone now
        if rep is None:
            self._repeats.pop(key, None)
            return
        self._repeats[key] = rep
        self._repeats.move_to_end(key)
        while len(self._repeats) > _REPEATS_MAX:  # least recently used first
            self._repeats.popitem(last=False)

    def _remember(
        self,
        tensors: list[Any],
        cached: _Layout,
        meta: SlotMeta,
        want: list[bool],
        generation: int,
        j: Journal,
        direct: bool,
        device: tuple[Any, Any, bool],
    ) -> _Repeat | None:
        """What `_again` needs to record the next call exactly like this one (None: it cannot,
        e.g. `refer` changed the static region's decisions, so the next call may differ)."""
        statics = self.statics
        if statics is not None and statics.generation != generation:
            return None
        candidates = {i for i, _ in cached.candidates.storages}
        # Per-call integers: the call index, the time, the versions of the storages that are
        # not static candidates (outputs, activations: their versions move every call).
        holes: list[int] = []  # in JSON order: storages (versions), then extra
        values: list[int] = []
        moving: set[int] = set()  # storages
        storages = list(meta.storages)
        for i, d in enumerate(storages):
            if "version" in d and i not in candidates:
                holes.append(_SENTINEL + 2 + len(moving))  # +0, +1: the index and time
                values.append(d["version"])
                storages[i] = {**d, "version": holes[-1]}
                moving.add(i)
        extra = dict(meta.extra)
        extra["call_index"], extra["time_ns"] = _SENTINEL, _SENTINEL + 1
        holes += [_SENTINEL, _SENTINEL + 1]
        values += [meta.call_index, meta.extra["time_ns"]]
        sentinels = SlotMeta(
            call_index=meta.call_index,
            target=meta.target,
            target_id=meta.target_id,
            called_as=meta.called_as,
            names=meta.names,
            args=meta.args,
            kwargs=meta.kwargs,
            storages=storages,
            tensors=meta.tensors,
            stream=meta.stream,
            capture_id=meta.capture_id,
            graph_id=meta.graph_id,
            extra=extra,
            outputs=meta.outputs,
        )
        tpl = j.template(sentinels, want, holes, (meta, values))
        if tpl is None:
            return None
        # Per storage in order (holes are in storage order): its first view, and its version where
        # it must stay (static candidates) or _MOVING where it fills a hole.
        versions: list[tuple[int, Any]] = []
        for i, f in enumerate(cached.firsts):
            if i in candidates:
                versions.append((f, version_of(tensors[f])))
            elif i in moving:
                versions.append((f, _MOVING))
        plan, whole, cuda = device
        return _Repeat(
            meta.target,
            tuple(weakref.ref(t) for t in tensors),
            tuple(versions),
            tpl,
            j,
            self._cuda,
            statics,
            statics.generation if statics is not None else -1,
            cached,
            tuple(t.data_ptr() for t in tensors),
            cuda,
            direct,
            plan,
            whole if plan is not None else None,
            {},
            frozenset(k for k, r in enumerate(cached.records) if r.storage in candidates),
            tuple(cached.storages[r.storage].storage_nbytes for r in cached.records),
        )

    def _again(self, rep: _Repeat, index: int, tensors: list[Any], same: bool = False) -> Any:
        """The exact-repeat path: the call repeats the one `rep` was made from (the same
        layouts, static operands, static versions and scalar arguments), so its slot is that
        one's with this call's index, time, stream and moving versions, and its copies are the
        same. `_MISS` where anything differs (the full path then runs). `same`: `tensors` are
        already known to be `rep`'s own objects (`_Lane.tensors` checked each against its
        reference).

        A tensor that is a new object over the same memory (what a serving loop passes every
        step: new activations and outputs in the blocks the caching allocator handed out last
        time) repeats when its storage has the recorded size: the repeat key compared its
        address, layout and flags already. A static candidate's tensor must be the same object,
        whose version says whether the static copy still holds."""
        if not same:
            for k, t in enumerate(tensors):  # the key holds their number and facts
                if not _stands_for(rep, k, t):
                    return _MISS
        # `version_of` inline, one pass: static candidates keep theirs, the others fill holes
        values: list[Any] = []
        for f, v in rep.versions:
            t = tensors[f]
            if t.is_inference():  # no version: equal to a candidate's None; no hole filled
                if v is not None:
                    return _MISS
            elif v is _MOVING:
                values.append(t._version)
            elif t._version != v:
                return _MISS
        cuda = rep.cuda_call
        if cuda and self._is_capturing(tensors):  # capture sites: the full path
            return _MISS
        with self.lock:
            j = self.journal
            statics = self.statics
            if (
                j is not rep.journal
                or self._cuda is not rep.devcopies
                or statics is not rep.statics
                or (statics is not None and statics.generation != rep.generation)
            ):
                return _MISS
            stream = 0
            if cuda:
                import torch

                from kdump.record.flight.devcopy import current_stream

                stream = current_stream(torch.cuda.current_device())
            values += (index, time.time_ns())
            slot = j.reserve_from(rep.template, values, stream, index)
            if slot is None:
                return _MISS
            self._reserved.slot = (slot.index, slot.seq)
            self.captures.next_site(False)
            self.fast_calls += 1
            layout = rep.layout
            self._last_eager[rep.target] = (slot.index, slot.seq, rep.ptrs)
            views = SpanViews(tensors, layout.firsts, layout.storages)
            if not cuda:
                return self._host_copy(slot, views, layout.outs)
            assert self._cuda is not None
            if rep.direct:
                after = self._cuda.direct(slot, views, None)
            else:
                plan = rep.plan
                rule = None
                if plan is not None and plan.rule_tensor is not None:
                    rule = tensors[plan.rule_tensor]
                after = self._cuda.copy(
                    slot, views, None, plan, rule, index, False, rep.whole, memo=rep.enqueued
                )
            return self._then_outputs(after, slot, views, layout.outs, None, rep.direct)

    @staticmethod
    def _is_capturing(cuda: list[Any]) -> bool:
        """Is the current stream capturing? Asked only for calls with CUDA tensors."""
        import torch

        return bool(cuda) and torch.cuda.is_current_stream_capturing()

    def _host_copy(
        self, slot: Slot, views: SpanViews, outputs: list[dict[str, Any]] = _NO_OUTPUTS
    ) -> Callable[[], None]:
        import torch

        for i in range(len(views)):
            if slot.has_payload(i) and views.nbytes(i):
                dst = torch.frombuffer(slot.payload(i), dtype=torch.uint8)
                dst.copy_(views[i])
        slot.commit()
        if not outputs:
            return slot.finish

        def after() -> None:
            # the call returned: its outputs' bytes (CPU spans: by address), `out`, then `done`
            slot.write_outputs([views.ptr(o["storage"]) for o in outputs])
            slot.finish()

        return after

    def _then_outputs(
        self,
        after: Callable[[], None],
        slot: Slot,
        views: SpanViews,
        outputs: list[dict[str, Any]],
        counter: int | None,
        direct: bool,
    ) -> Callable[[], None]:
        """A CUDA call's `after`, preceded by its outputs' copies on its stream (nothing added
        for a call without outputs: DeepGEMM's default costs what it did)."""
        if not outputs:
            return after
        cuda = self._cuda
        assert cuda is not None

        def then() -> None:
            cuda.outputs_after(slot, views, outputs, counter, direct)
            after()

        return then

    def _output_storages(
        self,
        st: HookState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[Any],
        records: list[Any],
        storages: list[Any],
    ) -> list[dict[str, Any]]:
        """The storages to copy again after the call, each {"storage", "tensors"} (the output
        tensors in it): `--outputs` as the sync recorder reads it, except that "default" keeps
        none for a target whose spec has a reference (it judges a replay without them)."""
        wanted = self.cfg.outputs
        if wanted == "none":
            return []
        if wanted == "default":
            try:
                from kdump.kernels import registry

                if registry.spec_for(st.id, st.names()).has_reference():
                    return []
            except Exception as exc:  # no spec to ask: a generic target
                log_once(f"ringspec:{st.id}", f"flight recorder: no spec for {st.id}: {exc}")
        from kdump.record.sync.recorder import output_indices

        idx = output_indices(wanted, st.spec, st.names(), tensors, args, kwargs)
        by_storage: dict[int, list[int]] = {}
        for i in idx:
            j = records[i].storage
            if storages[j].span_nbytes:  # nothing to copy back from an empty tensor
                by_storage.setdefault(j, []).append(i)
        return [{"storage": j, "tensors": ts} for j, ts in sorted(by_storage.items())]

    def _wanted(
        self,
        st: HookState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[Any],
        records: list[Any],
        storages: list[Any],
        roles: list[str | None] | None = None,
        outputs: list[dict[str, Any]] = _NO_OUTPUTS,
    ) -> tuple[list[bool], list[dict[str, Any]], dict[str, Any] | None]:
        """(per storage: copy its bytes before the call?, the `outputs` whose copy after the
        call fits, what did not fit or None). In priority order while the slot has room:
        routing / scalar / hint parameters and small inputs, then the other inputs, smallest
        first, then the outputs after the call, smallest first, then the outputs' bytes before
        the call (`_outputs_fit`). Storages only written are copied before the call only as
        outputs; static operands are taken out per call."""
        if roles is None:
            roles = _tensor_roles(st, args, kwargs, tensors)
        rank = [2] * len(storages)  # 0: first, 1: small, 2: other inputs, 3: never
        for i, s in enumerate(storages):
            if s.span_nbytes <= SMALL_BYTES:
                rank[i] = 1
        read = [False] * len(storages)  # does the call read any tensor of the storage?
        for r, role in zip(records, roles):
            if role in COPIED_ROLES:
                rank[r.storage] = min(rank[r.storage], 0)
            if role != "output":
                read[r.storage] = True
        for i in range(len(storages)):
            if not read[i]:  # outputs only: an input in the same buffer keeps its bytes
                rank[i] = 3
        assert self.journal is not None
        slot_bytes = self.journal.slot_bytes
        sizes = [int(s.span_nbytes) for s in storages]
        want, kept = _outputs_fit(sizes, rank, outputs, int(slot_bytes * SLOT_SHARE))
        if len(kept) == len(outputs):
            return want, kept, None
        # The smallest slot (a power of two) whose room keeps every output the same way.
        size = slot_bytes
        while len(_outputs_fit(sizes, rank, outputs, int(size * SLOT_SHARE))[1]) < len(outputs):
            size *= 2
        lost = [o for o in outputs if o not in kept]
        not_kept = {
            "tensors": [i for o in lost for i in o["tensors"]],  # argument paths: the caller's
            "bytes": sum(sizes[o["storage"]] for o in lost),
            "slot_bytes": size,
        }
        return want, kept, not_kept

    def _plan(
        self,
        st: HookState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: Any,
        tensors: list[Any],
    ) -> tuple[Any, Any]:
        """The row-gather plan of this call and its rule tensor (None, None: nothing gathered),
        cached per call signature (`_signature`)."""
        assert self._cuda is not None
        if not self._cuda.gathers:
            return None, None
        if key in self._plans:
            plan = self._plans[key]
        else:
            plan = None
            try:
                plan = _plan_for(st, args, kwargs, tensors)[0]
            except Exception as exc:  # a spec that cannot bind: no gather, the call still records
                log_once(f"ringplan:{st.id}", f"flight recorder: no row gather for {st.id}: {exc}")
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[key] = plan
        if plan is None:
            return None, None
        # the rule's values are this call's tensor (the cache keeps no tensor alive)
        return plan, tensors[plan.rule_tensor] if plan.rule_tensor is not None else None

    def _fit_plan(
        self, plan: Any, rule: Any, records: list[Any], storages: list[Any]
    ) -> tuple[Any, Any]:
        assert self._cuda is not None and self._cuda.tier is not None
        if plan.worst > self._cuda.tier.layout.ring_bytes:
            log_once(
                "ringfit",
                f"flight recorder: a call's rows ({plan.worst} bytes) exceed the device ring "
                f"({self._cuda.tier.layout.ring_bytes} bytes): raise KDUMP_DEVICE_BYTES",
            )
            return None, None
        gathered = {g.tensor for g in plan.gathers}
        for i, r in enumerate(records):  # a gathered storage holds only gathered tensors
            if r.storage in plan.storages and i not in gathered:
                return None, None
        return plan, rule

    def _static_refs(
        self,
        tensors: list[Any],
        records: list[Any],
        storages: list[Any],
        layout: _Layout,
        capturing: bool,
    ) -> list[dict | None]:
        """Per storage: its static reference (kdump.record.flight.statics), None when not static."""
        budget = self.cfg.ring.static_bytes
        if budget <= 0 or self.journal is None:
            return [None] * len(storages)
        if self.statics is None:
            self.statics = Statics(self.journal.path, budget)
        return self.statics.refer(
            tensors, records, storages, layout.roles, capturing, layout.candidates
        )

    def _site(self, key: tuple[int, int], target: str, tensors: list[Any]) -> Site:
        site = self.sites.get(key)
        if site is not None:
            return site
        j = self.journal
        assert j is not None
        counter = len(self.sites)
        over = self._cuda is not None and counter >= self._cuda.max_sites
        slot = None if over else j.pin_next()
        eager_seq = 0
        last = self._last_eager.get(target)
        if last is not None and last[2] == tuple(t.data_ptr() for t in tensors):
            if j.pin(last[0]):  # the buffers' values before capture stay
                eager_seq = last[1]
        site = Site(key[0], key[1], slot, counter, eager_seq)
        self.sites[key] = site
        return site

    # -- flush ------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the journal's complete slots as bundles now (the process keeps running and
        recording); never raises."""
        try:
            j = self.journal
            if j is None:
                return
            from kdump.record.flight.salvage import salvage_journal

            # The folder and names the launcher's salvage uses: flushing twice writes the same.
            out = Path(self.cfg.out) / f"flight.{socket.gethostname()}"
            if self._cuda is not None:
                with self.lock:
                    self._cuda.drain(wait=True)
            dumps, temporary = self._dump_device_tier(j.path)
            try:
                res = salvage_journal(
                    j.path,
                    out,
                    {"flushed": True},
                    remove=False,
                    device_dumps=dumps,
                    written=self._flushed,
                )
            finally:
                for p in temporary:
                    p.unlink(missing_ok=True)
            self.written = res.bundles
        except Exception as exc:
            log_once(f"ringflush:{self.pid}", f"flight recorder flush failed: {exc}")

    def _dump_device_tier(self, journal: Path) -> tuple[dict[int, Path] | None, list[Path]]:
        """A live process reads its own device tier: to `<journal>.cuda<N>` when no salvage
        process holds it (the launcher's salvage after exit finds it there), else to a temporary
        file for this flush only (the salvage process writes the final one)."""
        from kdump.record.flight.announce import dump_path

        cuda = self._cuda
        if cuda is None or cuda.tier is None:
            return None, []
        tier = cuda.tier
        final = dump_path(journal, tier.index)
        target = final.with_name(final.name + ".flush") if tier.held else final
        try:
            tier.dump(target)
        except Exception as exc:  # e.g. the context died of an illegal address
            log_once(f"ringdump:{self.pid}", f"flight recorder: device tier not readable: {exc}")
            return None, []
        return {tier.index: target}, [target] if tier.held else []

    def _retire(self) -> None:
        """Close with captured graphs alive: each replay still writes its slot, the device twin
        and ring, and the host `pre` marker through the mapped journal, so none of that memory
        may be unmapped, unregistered or freed while the process lives. Keep it all (the files
        go; their mappings stay), stop recording."""
        assert self.journal is not None
        _RETIRED.append((self.journal, self._cuda))
        for p in _retired_files(self.journal.path):
            p.unlink(missing_ok=True)
        if self.statics is not None:  # static copies are never captured: it can go
            self.statics.close(unlink=True)
            self.statics = None
        self.journal = None
        self._cuda = None

    def close(self) -> None:
        """End of a session in a live process: write the bundles, then remove the journal
        (under `kdump record` the launcher salvages instead, after the process is gone). With
        capture sites, captured graphs may replay after this: see `_retire`."""
        if self.journal is None:
            return
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        if not config.get_flag("KDUMP_RECORD"):
            self.flush()
            with self.lock:
                if self.sites:
                    self._retire()
                    return
                if self._cuda is not None:
                    self._cuda.release()
                    if self._cuda.tier is not None:
                        from kdump.record.flight.announce import dump_path

                        dump_path(self.journal.path, self._cuda.tier.index).unlink(missing_ok=True)
                if self.statics is not None:
                    self.statics.close(unlink=True)
                    self.statics = None
                raised_path(self.journal.path).unlink(missing_ok=True)
                self.journal.unlink()
                self.journal = None


def _retired_files(journal: Path) -> list[Path]:
    from kdump.record.flight.announce import dump_paths

    return [journal, raised_path(journal), *dump_paths(journal).values()]


def _signature(target: str, tensors: list[Any], args_tree: Any, kwargs_tree: Any) -> Any:
    """What a call's recorded layout depends on: its target, what the tensor records are made
    of (`layout_facts`: also requires_grad, the device and the storage's size, which change
    without moving an address) and the encoded argument trees (scalars, flags)."""
    from kdump.bundle.tensors import layout_facts

    return (
        target,
        tuple(layout_facts(t) for t in tensors),
        repr((args_tree, kwargs_tree)),
    )


_REPEATS_MAX = 1024  # repeat keys with a template (each layer of a model has its own)
_MISS = object()  # `_again`: not a repeat, take the full path
_MOVING = object()  # `_Repeat.versions`: a version that fills a hole (no fixed value)
_TENSOR = object()  # `_fingerprint`: a tensor follows (its index in the call's tensor list)
_KWARGS = object()  # `_fingerprint`: the keyword arguments follow
# Sentinels cut out of a template's JSON (`Journal.template`): 19 digits, not an address, a size
# or a time a call could carry.
_SENTINEL = 7_319_846_250_183_746_000
_LEAVES = frozenset({type(None), bool, int, str})  # exact types: equal values encode equally
_INLINE_LEAVES = frozenset({type(None), bool, int})  # `_walk`'s leaves without a length check
_LANE_LEAVES = _LEAVES  # a lane's leaves: compared with ==, encoded as their value
# A repeat key's bounds (argtree.encode cuts deeper or larger trees with placeholders, and the
# keys are kept): beyond them a call takes the full path.
_KEY_DEPTH = 16
_KEY_ITEMS = 2048  # entries of the flat key
_KEY_STR = 4096  # characters of one string


def _tensor_types() -> tuple[type, ...]:
    import torch

    return (torch.Tensor, torch.nn.Parameter)


_TENSOR_TYPES: tuple[type, ...] = ()


def _fingerprint(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The call's arguments as a flat list that compares equal exactly when their argument trees
    encode equally given the same tensors (containers, scalar types and values, which positions
    hold the same tensor object), and the tensors in argtree's order. None: a value whose
    encoding may change while it compares equal (a mutable or unknown object, a tensor
    subclass): such calls always take the full path."""
    global _TENSOR_TYPES
    if not _TENSOR_TYPES:
        _TENSOR_TYPES = _tensor_types()
    out: list[Any] = []
    tensors: list[Any] = []
    at: dict[int, int] = {}  # id -> index: the tensors stay alive in `tensors` meanwhile
    for v in args:
        if not _walk(v, out, tensors, at):
            return None  # type: ignore[return-value]
    out.append(_KWARGS)
    for k, v in kwargs.items():
        out.append(k)
        if not _walk(v, out, tensors, at):
            return None  # type: ignore[return-value]
    return out, tensors


def _walk(v: Any, out: list[Any], tensors: list[Any], at: dict[int, int], depth: int = 0) -> bool:
    if depth > _KEY_DEPTH or len(out) > _KEY_ITEMS:  # deep, large or self-referencing
        return False
    tp = type(v)
    if tp in _TENSOR_TYPES:
        i = at.get(id(v))
        if i is None:
            i = at[id(v)] = len(tensors)
            tensors.append(v)
        out += (_TENSOR, i)
        return True
    if tp in _LEAVES:
        if tp is str and len(v) > _KEY_STR:
            return False
        out += (tp, v)
        return True
    if tp is tuple or tp is list:
        out += (tp, len(v))
        inline = depth < _KEY_DEPTH  # what `_walk(x, ..., depth + 1)` checks first
        for x in v:  # a loop, not all(): a generator per container costs a microsecond
            # Tensors and non-string leaves inline, as `_walk` would encode them: a call per
            # item was a third of the walk for DeepGEMM's (tensor, scales) pairs.
            tx = type(x)
            if inline and len(out) <= _KEY_ITEMS:
                if tx in _TENSOR_TYPES:
                    i = at.get(id(x))
                    if i is None:
                        i = at[id(x)] = len(tensors)
                        tensors.append(x)
                    out += (_TENSOR, i)
                    continue
                if tx in _INLINE_LEAVES:
                    out += (tx, x)
                    continue
            if not _walk(x, out, tensors, at, depth + 1):
                break
        else:
            return True
        return False
    if tp is dict:
        out += (tp, len(v))
        for k, x in v.items():
            if not (
                _walk(k, out, tensors, at, depth + 1) and _walk(x, out, tensors, at, depth + 1)
            ):
                break
        else:
            return True
        return False
    if tp is float:  # the encoding is the repr: -0.0 and 0.0 differ, nan equals nan
        out += (tp, repr(v))
        return True
    import enum

    import torch

    if tp is torch.dtype or tp is torch.device:
        out += (tp, v)
        return True
    if isinstance(v, enum.Enum) and type(v.value) in _LEAVES:
        # by value: flag values without a name (IntFlag(0), unnamed bits) share name None
        out += (tp, type(v.value), v.value)
        return True
    return False


def _repeat_key(
    target: str, called_as: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, list[Any]] | None:
    """(key, tensors): calls with equal keys encode equal argument trees and tensor layouts
    (`_fingerprint`, `_facts_of`); None: the call cannot repeat exactly (`_fingerprint`)."""
    seen = _fingerprint(args, kwargs)
    if seen is None:
        return None
    structure, tensors = seen
    return (target, called_as, tuple(structure), _facts_of(tensors)), tensors


def _probe(target: str, called_as: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where to look for a call's lane: the addresses of its tensor arguments and the
    identities of its other arguments, the same of the items of its list and tuple arguments
    one level down, and its keyword names (cheap, and distinct for the layers of a model, whose
    weights differ; a lane checks the rest). Addresses, not identities, for tensors: a serving
    loop's activations are new objects over the same memory at every step. None where a
    tensor has no address to give (no storage): no lane, the repeat key decides."""
    global _TENSOR_TYPES
    if not _TENSOR_TYPES:
        _TENSOR_TYPES = _tensor_types()
    kinds = _TENSOR_TYPES
    ids: list[Any] = [target, called_as, len(args), *kwargs]
    try:
        for v in (*args, *kwargs.values()) if kwargs else args:
            tp = type(v)
            if tp is tuple or tp is list:
                ids.append(len(v))
                ids += [x.data_ptr() if type(x) in kinds else id(x) for x in v]
            elif tp in kinds:
                ids.append(v.data_ptr())
            else:
                ids.append(id(v))
    except RuntimeError:
        return None
    return tuple(ids)


class _Lane:
    """A repeat recognised without its repeat key: the arguments' shape one level deep (list and
    tuple arguments of tensors and plain leaves), the tensors expected at each place (weak
    references: the same objects, or new objects over the same memory as
    `RingRecorder._again` takes them) and their `_facts_of`. `tensors` gives the call's tensor
    list, as `_repeat_key` would, exactly when the key would be the repeat's own; else None."""

    __slots__ = ("containers", "facts", "kwkeys", "leaves", "nargs", "places", "rep")

    def __init__(self, rep: _Repeat, nargs: int, kwkeys: tuple[str, ...]) -> None:
        self.rep = rep
        self.nargs = nargs
        self.kwkeys = kwkeys
        self.containers: list[tuple[int, type, int]] = []  # (argument, type, length)
        self.leaves: list[tuple[int, int, type, Any]] = []  # (argument, item or -1, type, value)
        # (argument, item or -1, tensor index, its `_facts_of` at its first place, else None)
        self.places: list[tuple[int, int, int, Any]] = []
        self.facts: tuple[Any, ...] = ()

    @classmethod
    def of(
        cls, rep: _Repeat, args: tuple[Any, ...], kwargs: dict[str, Any], seen: tuple[Any, Any]
    ) -> _Lane | None:
        """The lane of a call whose repeat key `seen` found `rep`; None for arguments deeper
        than a lane checks (they keep the repeat key)."""
        key, tensors = seen
        lane = cls(rep, len(args), tuple(kwargs))
        at = {id(t): i for i, t in enumerate(tensors)}
        for i, v in enumerate((*args, *kwargs.values())):
            tp = type(v)
            if tp in _TENSOR_TYPES:
                lane.places.append((i, -1, at[id(v)], None))
            elif tp in _LANE_LEAVES and not (tp is str and len(v) > _KEY_STR):
                lane.leaves.append((i, -1, tp, v))
            elif tp is tuple or tp is list:
                lane.containers.append((i, tp, len(v)))
                for j, x in enumerate(v):
                    tx = type(x)
                    if tx in _TENSOR_TYPES:
                        lane.places.append((i, j, at[id(x)], None))
                    elif tx in _LANE_LEAVES and not (tx is str and len(x) > _KEY_STR):
                        lane.leaves.append((i, j, tx, x))
                    else:
                        return None
            else:
                return None
        if len(at) != len(rep.refs):
            return None
        lane.facts = facts = key[3]
        # Each tensor's facts are checked where it first appears (`tensors`): one pass.
        firsts: set[int] = set()
        for n, (i, j, k, _) in enumerate(lane.places):
            if k not in firsts:
                firsts.add(k)
                lane.places[n] = (i, j, k, facts[k])
        if len(firsts) != len(facts):  # every tensor has a place: `tensors` fills each
            return None
        return lane

    def tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
        if len(args) != self.nargs:
            return None
        if kwargs:
            if tuple(kwargs) != self.kwkeys:
                return None
            vals = (*args, *kwargs.values())
        elif self.kwkeys:
            return None
        else:  # the common case: no keywords, nothing to join
            vals = args
        for i, tp, n in self.containers:
            c = vals[i]
            if type(c) is not tp or len(c) != n:
                return None
        for i, j, tp, v in self.leaves:
            x = vals[i] if j < 0 else vals[i][j]
            if type(x) is not tp or x != v:
                return None
        rep = self.rep
        refs = rep.refs
        out: list[Any] = [None] * len(refs)
        renewed = False  # a tensor is a new object (over the same memory, if its facts hold)
        for i, j, k, facts in self.places:
            x = vals[i] if j < 0 else vals[i][j]
            if facts is None:  # a later place of tensor k: the object of its first place
                if x is not out[k]:
                    return None
                continue
            # `_facts_of([x])[0] != facts`, inline: a call per tensor costs the lane a
            # microsecond; the first fact (the address) tells most changes apart
            p = x.data_ptr()
            if (
                p,
                x.shape,
                x.stride(),
                x.dtype,
                x.storage_offset(),
                x.is_conj(),
                x.is_neg(),
                x.requires_grad,
                None if p else x.device,
            ) != facts:
                return None
            if x is not refs[k]():
                if not _stands_for(rep, k, x):
                    return None
                renewed = True
            out[k] = x
        # As the repeat key: distinct objects where the template had them (one object at two
        # first places is another key).
        if renewed and len(set(map(id, out))) != len(out):
            return None
        return out


def _stands_for(rep: Any, k: int, t: Any) -> bool:
    """Whether `t` may stand for tensor `k` of the call `rep` (a `_Repeat`) was made from, its
    facts being equal: that very object, or, unless the tensor is pinned (a static candidate:
    its version belongs to its object), a new object whose storage has the recorded size."""
    if rep.refs[k]() is t:
        return True
    if k in rep.pinned:
        return False
    try:
        return bool(t.untyped_storage().nbytes() == rep.storage_nbytes[k])
    except Exception:  # no storage to ask: the full path decides
        return False


def _facts_of(tensors: list[Any]) -> tuple[tuple[Any, ...], ...]:
    """What the recorded layout of each tensor depends on besides its version: `_signature`'s
    facts, the lazy conj / neg bits and requires_grad (`.data =` and `requires_grad_` change them
    without bumping the version); the device where the address does not tell it. One loop for
    all of a call's tensors: a call per tensor costs the repeat path a microsecond."""
    out = []
    for t in tensors:
        p = t.data_ptr()
        out.append(
            (
                p,
                t.shape,
                t.stride(),
                t.dtype,
                t.storage_offset(),
                t.is_conj(),
                t.is_neg(),
                t.requires_grad,
                None if p else t.device,
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class _Repeat:
    """A recorded eager call, as the exact-repeat path replays calls of its repeat key
    (`_repeat_key`): its tensors (weak references: a static candidate's must be the same object
    again; the others may be new objects over the same memory), the versions of its static
    candidates, the slot template and what the copies need."""

    target: str
    refs: tuple[Any, ...]
    # (tensor index, version) of static candidates, (tensor index, _MOVING) of each version
    # that fills a hole; in storage order (the holes' order)
    versions: tuple[tuple[int, Any], ...]
    template: SlotTemplate
    journal: Journal
    devcopies: Any
    statics: Statics | None
    generation: int
    layout: _Layout
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


class _Layout:
    """What stays the same between calls of one signature: storages and tensor records, the
    copy choice and their JSON (no tensor references: the cache must not keep memory alive)."""

    def __init__(
        self,
        storages: list[Any],
        records: list[Any],
        want: tuple[bool, ...],
        storage_dicts: list[dict[str, Any]],
        tensor_dicts: list[dict[str, Any]],
        trees: tuple[list[Any], dict[str, Any]],
        names: list[str] | None,
        roles: list[str | None],
        firsts: tuple[int, ...],
        outs: list[dict[str, Any]] = _NO_OUTPUTS,
        not_kept: dict[str, Any] | None = None,
    ) -> None:
        self.storages = storages
        self.records = records
        self.want = want
        self.storage_dicts = storage_dicts
        self.tensor_dicts = tensor_dicts
        self.trees = trees
        self.names = names
        self.roles = roles  # the spec role of each tensor (static operands are found by it)
        self.firsts = firsts  # per storage: the index of the first tensor viewing it
        self.outs = outs  # the outputs copied after the call ({"storage", "tensors"} each)
        self.not_kept = not_kept  # the outputs that did not fit (the slot's extra says so)
        self.candidates = Candidates.of(records, storages, roles)  # which may be static
        # The last call's storage dicts with versions and static references, reused while they
        # repeat (the journal then reuses their JSON); the plan's JSON, per plan object.
        self._meta: tuple[Any, list[dict[str, Any]]] | None = None
        self._plan_json: tuple[Any, dict[str, Any]] | None = None

    def storage_meta(
        self,
        tensors: list[Any],
        records: list[Any],
        refs: list[dict | None],
        lazy: list[dict | None],
    ) -> list[dict[str, Any]]:
        """This call's storage dicts (kdump.record.flight.statics.storage_meta): the previous call's
        list object when every value is the same."""
        versions = tuple(version_of(tensors[f]) for f in self.firsts)
        key = (versions, refs, lazy)
        if self._meta is not None and self._meta[0] == key:
            return self._meta[1]
        dicts = storage_meta([dict(d) for d in self.storage_dicts], tensors, records, refs, lazy)
        self._meta = (key, dicts)
        return dicts

    def plan_json(self, plan: Any) -> dict[str, Any]:
        """The plan's JSON, made once per plan object (plans are frozen and cached per
        signature); shared between calls: only encoded, never changed."""
        if self._plan_json is None or self._plan_json[0] is not plan:
            self._plan_json = (plan, plan.to_json())
        return self._plan_json[1]


def _outputs_fit(
    sizes: list[int], rank: list[int], outputs: list[dict[str, Any]], room: int
) -> tuple[list[bool], list[dict[str, Any]]]:
    """`RingRecorder._wanted`'s choice for a slot whose payloads may take `room` bytes: (per
    storage: copied before the call, the outputs copied after it). Inputs first (`rank` 0-2,
    smallest first within a rank), then the outputs after the call, smallest first, then the
    bytes before the call of storages only written (rank 3) that are outputs."""
    want = [False] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (rank[i], sizes[i])):
        if sizes[i] == 0:
            # Nothing to copy or to miss: empty tensors share one storage (null pointer), so
            # an empty output must not make an empty input missing.
            want[i] = True
            continue
        n = sizes[i] + 64  # payloads are 64-byte aligned
        if rank[i] < 3 and n <= room:
            want[i] = True
            room -= n
    kept = []
    for o in sorted(outputs, key=lambda o: sizes[o["storage"]]):
        n = sizes[o["storage"]] + 64
        if n <= room:
            kept.append(o)
            room -= n
    for o in sorted(outputs, key=lambda o: sizes[o["storage"]]):
        j = o["storage"]
        if not want[j] and o in kept and sizes[j] + 64 <= room:
            want[j] = True  # what the call overwrote: a replay tells written from unwritten
            room -= sizes[j] + 64
    return want, [o for o in outputs if o in kept]


def _paths(
    names: Any, args_tree: list[Any], kwargs_tree: dict[str, Any], not_kept: dict[str, Any]
) -> list[str]:
    """The argument paths of `not_kept`'s tensor indices."""
    from kdump.bundle import argtree

    try:
        paths = argtree.tensor_paths(names, args_tree, kwargs_tree)
    except Exception:  # a tree the paths cannot walk: the indices still say which
        paths = []
    return [paths[i] if i < len(paths) else f"tensor{i}" for i in not_kept["tensors"]]


def _storage_dict(s: Any) -> dict[str, Any]:
    return {
        "device": s.device,
        "base_ptr": s.base_ptr,
        "storage_nbytes": s.storage_nbytes,
        "span_start": s.span_start,
        "span_nbytes": s.span_nbytes,
    }


def _tensor_dict(r: Any) -> dict[str, Any]:
    return {
        "storage": r.storage,
        "dtype": r.dtype,
        "shape": list(r.shape),
        "stride": list(r.stride),
        "storage_offset": r.storage_offset,
        "requires_grad": r.requires_grad,
        "data_ptr": r.data_ptr,
        "nbytes": r.numel * r.itemsize,
    }


class SpanViews:
    """Per storage: a uint8 view of its span (the bytes the kernel reads), made when first
    asked for, and its address and size without one: a call's copies need the bytes of a few
    storages, device copies only their addresses."""

    __slots__ = ("_firsts", "_storages", "_tensors", "_views")

    def __init__(self, tensors: list[Any], firsts: tuple[int, ...], storages: list[Any]) -> None:
        self._tensors = tensors
        self._firsts = firsts
        self._storages = storages
        self._views: list[Any] = [None] * len(storages)

    def __len__(self) -> int:
        return len(self._storages)

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> Any:
        v = self._views[i]
        if v is None:
            from kdump.bundle.tensors import _byte_view

            s = self._storages[i]
            v = self._views[i] = _byte_view(
                self._tensors[self._firsts[i]], s.span_start, s.span_nbytes
            )
        return v

    def ptr(self, i: int) -> int:
        """The address of storage i's span (what its view's data_ptr() says)."""
        s = self._storages[i]
        return int(s.base_ptr) + int(s.span_start)

    def nbytes(self, i: int) -> int:
        return int(self._storages[i].span_nbytes)


def _span_views(tensors: list[Any], records: list[Any], storages: list[Any]) -> SpanViews:
    """Per storage: its span view (`SpanViews`)."""
    return SpanViews(tensors, first_views(records, len(storages)), storages)


def _tensor_roles(
    st: HookState, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[Any]
) -> list[str | None]:
    """The spec role of each tensor's parameter (None: unknown)."""
    try:
        from kdump.kernels import registry

        spec = registry.spec_for(st.id, st.names())
        roles = {p.name: p.role.value for p in getattr(spec, "params", ())}
    except Exception:
        return [None] * len(tensors)
    names = st.names() or ()
    by_id: dict[int, str | None] = {}
    for name, value in list(zip(names, args)) + list(kwargs.items()):
        from kdump.bundle import argtree

        for t in argtree.tensors_in(value):
            by_id.setdefault(id(t), roles.get(name))
    return [by_id.get(id(t)) for t in tensors]


def _plan_for(
    st: HookState, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[Any]
) -> tuple[Any, Any]:
    """The spec's touch declaration turned into a gather plan (kdump.record.flight.gather)."""
    from kdump.bundle import argtree
    from kdump.bundle.tensors import group_storages
    from kdump.kernels import registry
    from kdump.record.flight import gather

    spec = registry.spec_for(st.id, st.names())
    bound = spec.bind(args, kwargs)
    touches = spec.touches(bound)
    if not touches:
        return None, None
    t = touches[0]  # one row rule per snapshot
    by_id = {id(x): i for i, x in enumerate(tensors)}
    idx = [by_id[id(x)] for x in argtree.tensors_in(bound.get(t.param)) if id(x) in by_id]
    rule_t = bound.get(t.by) if t.by else None
    if not idx or (t.rule != "all" and id(rule_t) not in by_id):
        return None, None
    if t.rule != "all":
        import torch

        if not isinstance(rule_t, torch.Tensor) or rule_t.dtype != torch.int32:
            return None, None
        if not rule_t.is_contiguous() or rule_t.device != tensors[idx[0]].device:
            return None, None
    storages, records = group_storages(tensors)
    plan = gather.make_plan(
        tensors,
        records,
        storages,
        idx,
        t.rule,
        by_id.get(id(rule_t)) if rule_t is not None else None,
        t.row_dims,
        t.alignment,
    )
    return (plan, rule_t) if plan is not None else (None, None)


def process_block() -> dict[str, Any]:
    """The journal's process block: argv and the recorded environment (redacted)."""
    return {
        "argv": config.redact_argv(list(sys.argv)),
        "pid": os.getpid(),
        "env": config.recorded_environment(),
    }
