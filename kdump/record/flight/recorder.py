"""The flight recorder (`mode="ring"`): the last calls of a process in a crash-proof journal.

Per recorded call the host writes a compact header into the next journal slot (call index,
target, argument tree and layouts, stream, capture and graph ids) and the call's small arguments
are copied into the slot before the kernel runs: by the host for CPU tensors, asynchronously on
the call's own stream for CUDA tensors (the journal is pinned shared memory), with the slot's
markers ordered around them (kdump.record.flight.journal). Nothing synchronises on the hot path.

What is copied, in priority order while the slot has room: arguments whose spec role is routing,
scalar or hint, inputs no bigger than `layout.SMALL_BYTES`, then the other inputs, smallest
first; what does not fit (weights, big activations) keeps its layout only (salvage marks it
missing).

Outputs (`--outputs`; by default every tensor argument of a target whose spec has no reference,
none for one that has) are copied again AFTER the call, on its stream, into the slot's room
left after the inputs, smallest first (kdump.record.flight.layout); under CUDA-graph capture
those copies are captured after the kernel, so every replay refreshes them. Their bytes from
before the call are the inputs' (kept where they fit); outputs that do not fit are named in the
slot's `extra["outputs_not_kept"]` with the slot size that would hold them.

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

The recorder's parts: a call signature's layout and copy choice (kdump.record.flight.layout),
the device copy plan (kdump.record.flight.plan), capture sites (kdump.record.flight.sites), the
repeat key and lanes (kdump.record.repeat) and the slot templates of the exact-repeat path
(kdump.record.flight.again). `RingRecorder._before` takes a call to the exact-repeat path
(`_again`) or the full path (`_record`).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdump import config
from kdump.format.journal import SlotMeta, SlotTooSmall
from kdump.format.records import launch_json
from kdump.log import log_once
from kdump.record.flight.again import MISS, MOVING, FlightRepeat, learn
from kdump.record.flight.journal import Journal, Slot
from kdump.record.flight.layout import NO_OUTPUTS, Layout, SpanViews, signature
from kdump.record.flight.notes import RaisedNotes, write_last_words
from kdump.record.flight.plan import device_plan
from kdump.record.flight.salvage import raised_path
from kdump.record.flight.sites import (
    CaptureTracker,
    Site,
    pin_site,
    report_captures_to,
    stop_reporting_to,
)
from kdump.record.flight.statics import Statics, lazy_bits
from kdump.record.hooks import HookState
from kdump.record.launch_hook import launch_key, launch_of
from kdump.record.repeat import Lane, Repeats, Seen, probe, repeat_key, stands_for

if TYPE_CHECKING:
    from kdump.record.config import RecordConfig
    from kdump.record.flight.devcopy import DeviceCopies
    from kdump.record.protocol import SessionCalls

# Journals and device tiers of closed recorders that captured graphs: kept for
# the life of the process, since those graphs write into them at every replay.
_RETIRED: list[tuple[Any, Any]] = []

REPEATS_MAX = 1024  # repeat keys with a template (each layer of a model has its own)
LAYOUTS_MAX = 256  # call signatures whose layout is kept (the cache is cleared beyond)


class RingRecorder:
    """The Recorder of mode ring (see the module docstring)."""

    mode = "ring"

    def __init__(self, cfg: RecordConfig, session: SessionCalls) -> None:
        self.cfg = cfg
        self.session = session
        self._init_process()

    def _init_process(self) -> None:
        self.lock = threading.RLock()
        self._reserved = threading.local()  # this thread's current call: (slot, seq)
        self._raised = RaisedNotes()  # the calls that raised
        self.journal: Journal | None = None
        self.pid = os.getpid()
        self.errors = 0
        self.written: list[Path] = []
        self._flushed: dict[Path, Any] = {}  # what each flush wrote: unchanged slots are kept
        self.captures = CaptureTracker()
        self.sites: dict[tuple[int, int], Site] = {}
        self._last_eager: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._target_ids: dict[str, int] = {}
        self._cuda: DeviceCopies | None = None
        self._plans: dict[Any, Any] = {}
        self._layouts: dict[Any, Layout] = {}
        # per repeat key (kdump.record.repeat): `_again`'s repeats, least recently used first
        self._repeats: Repeats[FlightRepeat] = Repeats(REPEATS_MAX, 4 * REPEATS_MAX)
        self._lanes: dict[Any, Lane] = {}  # `probe` -> the repeat its arguments took last
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
            report_captures_to(self)
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
        """The process' last words next to the journal (kdump.record.flight.notes)."""
        j = self.journal
        if j is not None:
            write_last_words(j.path, kind, exc, tb)

    def _note_raised(self, reserved: tuple[int, int], index: int, exc: BaseException) -> None:
        """A recorded call raised: a note next to the journal (kdump.record.flight.notes)."""
        j = self.journal
        if j is None:
            return
        with self.lock:
            self._raised.note(j.path, reserved, index, exc)

    # -- torch's graph capture (kdump.record.flight.sites.report_captures_to) ---------------------
    def capture_begins(self) -> None:
        """A new capture id; queued eager host copies are drained, never into the graph."""
        self.captures.begin()
        if self._cuda is not None:
            with self.lock:
                self._cuda.drain()

    def capture_ends(self) -> None:
        """The side branch of the host copies joined back into the capture before it ends."""
        self.captures.end()
        if self._cuda is not None:
            try:
                self._cuda.join_capture()
            except Exception as exc:
                log_once("ringjoin", f"flight recorder: joining its copy branch: {exc}")

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
        self._reserved.slot = None
        after = None
        try:
            if self.session.trigger(st.id).select(index, args, kwargs):
                after = self._before(st, index, called_as, args, kwargs, launch_of(fn))
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

    def _before(
        self,
        st: HookState,
        index: int,
        called_as: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        launch: tuple[Any, list[str]] = (None, []),
    ) -> Callable[[], None] | None:
        """Record the call before it runs; what to run after it (None: nothing). A repeat of a
        call recorded before takes the exact-repeat path (`_again`), found by its lane or its
        repeat key (kdump.record.repeat); any other call the full path (`_record`). `launch`:
        a Triton launch's record and notes (kdump.record.launch_hook.launch_of); its record is
        part of the repeat keys, since the slot template holds it."""
        found = lane = tensors = None
        lkey = launch_key(launch[0])
        try:
            found = probe(st.id, called_as, args, kwargs)
            if lkey is not None and found is not None:
                found = (found, lkey)
            lane = self._lanes.get(found)
            if lane is not None:
                tensors = lane.tensors(args, kwargs)
        except Exception as exc:  # the repeat path is an optimisation: never a failed call
            log_once(f"repeatlane:{self.pid}", f"flight recorder: no lane ({exc!r})")
        if lane is not None and tensors is not None:
            done = self._again(lane.rep, index, tensors, same=True)
            if done is not MISS:
                return done  # type: ignore[return-value]
        try:
            seen = repeat_key(st.id, called_as, args, kwargs)
            if lkey is not None and seen is not None:  # (target, called_as, structure, facts)
                key = seen[0]
                seen = ((key[0], (key[1], lkey), *key[2:]), seen[1])
        except Exception as exc:
            log_once(f"repeatkey:{self.pid}", f"flight recorder: no repeat path ({exc!r})")
            seen = None
        if seen is not None:
            rep = self._repeats.use(seen[0])
            if rep is not None:
                done = self._again(rep, index, seen[1])
                if done is not MISS:
                    lane = Lane.of(rep, args, kwargs, seen)
                    if lane is not None and found is not None:
                        if len(self._lanes) >= 4 * REPEATS_MAX:
                            self._lanes.clear()
                        self._lanes[found] = lane
                    return done  # type: ignore[return-value]
        return self._record(st, index, called_as, args, kwargs, seen, launch)

    def _record(
        self,
        st: HookState,
        index: int,
        called_as: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        seen: Seen | None,
        launch: tuple[Any, list[str]] = (None, []),
    ) -> Callable[[], None] | None:
        """The full path: encode the arguments, take the signature's layout (`Layout`), the
        static operands, the device copy plan and the capture site, reserve the slot, learn the
        repeat (`_learn`) and start the copies (`_host_copy`, `_device_copy`)."""
        import torch

        from kdump.format import argtree

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
                key = signature(st.id, tensors, args_tree, kwargs_tree)
                layout = self._layouts.get(key)
                if layout is None:
                    layout = self._layout(key, st, args, kwargs, tensors, (args_tree, kwargs_tree))
                want = list(layout.want)
                generation, storage_dicts = self._storage_dicts(tensors, layout, capturing, want)
                site_key = self.captures.next_site(capturing)
                extra = self._extra(index, capturing, layout)
                if launch[1]:
                    extra["notes"] = list(launch[1])
                outputs = layout.outs
                plan = rule = whole = None
                # One device tier per process, on the device of its first call; a call on another
                # device takes the plain per-payload copies.
                direct = (
                    bool(cuda) and self._cuda is not None and cuda[0].device != self._cuda.device
                )
                if cuda and self._cuda is not None and not direct:
                    plan, rule, whole = device_plan(
                        self._cuda, self._plans, st, args, kwargs, key, tensors, layout, want, extra
                    )
                site = None
                if site_key is not None:
                    site = self._site(site_key, st.id, tensors, extra)
                    if site.slot is None:  # over budget: the header only
                        want = [False] * len(layout.storages)
                        outputs = []
                        plan = None
                meta = self._meta(
                    st, index, called_as, layout, storage_dicts, cuda, site, extra, outputs
                )
                if launch[0] is not None:
                    meta = replace(meta, launch=launch_json(launch[0]))
                slot = j.reserve(meta, index=site.slot if site else None, want=want)
                self._reserved.slot = (slot.index, slot.seq)
                views = SpanViews(tensors, layout.firsts, layout.storages)
                if seen is not None and site is None and not capturing:
                    self._learn(
                        seen, tensors, layout, meta, want, generation, j, direct,
                        (plan, whole, bool(cuda)),
                    )  # fmt: skip
                if site is None:
                    ptrs = tuple(t.data_ptr() for t in tensors)
                    self._last_eager[st.id] = (slot.index, slot.seq, ptrs)
                if not cuda:
                    return self._host_copy(slot, views, outputs)
                return self._device_copy(
                    slot, views, outputs, site, direct, plan, rule, whole, index, capturing
                )

    def _layout(
        self,
        key: Any,
        st: HookState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[Any],
        trees: tuple[list[Any], dict[str, Any]],
    ) -> Layout:
        """The layout of a call signature not seen yet (or no longer cached), now cached."""
        assert self.journal is not None
        layout = Layout.of_call(
            st, args, kwargs, tensors, trees, self.cfg.outputs, self.journal.slot_bytes
        )
        if len(self._layouts) > LAYOUTS_MAX:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout

    def _storage_dicts(
        self, tensors: list[Any], layout: Layout, capturing: bool, want: list[bool]
    ) -> tuple[int, list[dict[str, Any]]]:
        """(the static region's generation before this call, the call's storage dicts).
        Static operands (weights): copied once per (storage, version) into the static region,
        or recorded by reference; never into the slot (they leave `want`). Per call: versions
        move."""
        generation = self.statics.generation if self.statics is not None else -1
        refs = self._static_refs(tensors, layout, capturing)
        for i, ref in enumerate(refs):
            if ref is not None:
                want[i] = False
        storage_dicts = layout.storage_dicts
        lazy = lazy_bits(tensors, layout.records, len(refs), layout.firsts)
        if any(r is not None for r in refs) or any(lazy):
            storage_dicts = layout.storage_meta(tensors, layout.records, refs, lazy)
        return generation, storage_dicts

    def _static_refs(
        self, tensors: list[Any], layout: Layout, capturing: bool
    ) -> list[dict | None]:
        """Per storage: its static reference (kdump.record.flight.statics), None when not static."""
        storages = layout.storages
        budget = self.cfg.ring.static_bytes
        if budget <= 0 or self.journal is None:
            return [None] * len(storages)
        if self.statics is None:
            self.statics = Statics(self.journal.path, budget)
        return self.statics.refer(
            tensors, layout.records, storages, layout.roles, capturing, layout.candidates
        )

    def _extra(self, index: int, capturing: bool, layout: Layout) -> dict[str, Any]:
        """The slot's `extra` before the device plan and the capture site add theirs."""
        extra: dict[str, Any] = {
            "call_index": index,
            "pid": self.pid,
            "time_ns": time.time_ns(),
            "mode": "ring",
            "capturing": capturing,
            "tiers": ["host"],  # bulky arguments beyond the slot keep their layouts only
        }
        if layout.not_kept is not None:
            extra["outputs_not_kept"] = layout.not_kept
        return extra

    def _site(
        self, key: tuple[int, int], target: str, tensors: list[Any], extra: dict[str, Any]
    ) -> Site:
        """The capture site of a call made during capture (kdump.record.flight.sites), named in
        `extra`; one over budget drops the device plan from it."""
        assert self.journal is not None
        max_sites = self._cuda.max_sites if self._cuda is not None else None
        last = self._last_eager.get(target)
        site = pin_site(self.sites, key, last, tensors, self.journal, max_sites)
        extra["site"] = {
            "capture": site.capture_id,
            "position": site.position,
            "eager_seq": site.eager_seq,
        }
        if site.slot is None:
            extra["site_over_budget"] = True
            extra.get("device", {}).pop("plan", None)
            extra.get("device", {}).pop("whole", None)
        return site

    def _meta(
        self,
        st: HookState,
        index: int,
        called_as: str,
        layout: Layout,
        storage_dicts: list[dict[str, Any]],
        cuda: list[Any],
        site: Site | None,
        extra: dict[str, Any],
        outputs: list[dict[str, Any]],
    ) -> SlotMeta:
        stream = 0
        if cuda:
            import torch

            from kdump.record.flight.devcopy import current_stream

            stream = current_stream(torch.cuda.current_device())
        # equal by the key; the cached objects let the journal reuse their JSON
        args_tree, kwargs_tree = layout.trees
        return SlotMeta(
            call_index=index,
            target=st.id,
            target_id=self._target_ids.setdefault(st.id, len(self._target_ids) + 1),
            called_as=called_as,
            names=layout.names,
            args=args_tree,
            kwargs=kwargs_tree,
            storages=storage_dicts,
            tensors=layout.tensor_dicts,
            stream=stream,
            capture_id=site.capture_id if site else 0,
            graph_id=site.capture_id if site else 0,
            extra=extra,
            outputs=outputs,
        )

    def _device_copy(
        self,
        slot: Slot,
        views: SpanViews,
        outputs: list[dict[str, Any]],
        site: Site | None,
        direct: bool,
        plan: Any,
        rule: Any,
        whole: Any,
        index: int,
        capturing: bool,
    ) -> Callable[[], None] | None:
        """Start a CUDA call's copies on its stream (kdump.record.flight.devcopy)."""
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

    def _learn(
        self,
        seen: Seen,
        tensors: list[Any],
        layout: Layout,
        meta: SlotMeta,
        want: list[bool],
        generation: int,
        j: Journal,
        direct: bool,
        device: tuple[Any, Any, bool],
    ) -> None:
        """After a full-path eager call: the second time its repeat key is seen (or when its
        template stopped matching), keep what `_again` needs (kdump.record.flight.again.learn);
        the first time only note the key (a call that never repeats pays nothing for
        templates). Never raises: the call is reserved, it must still be recorded."""
        key = seen[0]
        try:
            if not self._repeats.sighted_before(key):
                return
            rep = None
            if len(seen[1]) == len(tensors) and all(a is b for a, b in zip(seen[1], tensors)):
                rep = learn(
                    tensors, layout, meta, want, generation, j, self.statics, self._cuda,
                    direct, device,
                )  # fmt: skip
            self._lanes.clear()  # a lane leads to the template a key had: it may be gone now
            if rep is None:
                self._repeats.pop(key, None)
                return
            self._repeats.keep(key, rep)
        except Exception as exc:
            self._repeats.pop(key, None)
            self._lanes.clear()
            log_once(
                f"repeatnote:{self.pid}",
                f"flight recorder: no repeat template ({type(exc).__name__}: {exc})",
            )

    def _again(self, rep: FlightRepeat, index: int, tensors: list[Any], same: bool = False) -> Any:
        """The exact-repeat path: the call repeats the one `rep` was made from (the same
        layouts, static operands, static versions and scalar arguments), so its slot is that
        one's with this call's index, time, stream and moving versions, and its copies are the
        same. `MISS` where anything differs (the full path then runs). `same`: `tensors` are
        already known to be `rep`'s own objects (`Lane.tensors` checked each against its
        reference).

        A tensor that is a new object over the same memory (what a serving loop passes every
        step: new activations and outputs in the blocks the caching allocator handed out last
        time) repeats when its storage has the recorded size: the repeat key compared its
        address, layout and flags already. A static candidate's tensor must be the same object,
        whose version says whether the static copy still holds."""
        if not same:
            for k, t in enumerate(tensors):  # the key holds their number and facts
                if not stands_for(rep, k, t):
                    return MISS
        # `version_of` inline, one pass: static candidates keep theirs, the others fill holes
        values: list[Any] = []
        for f, v in rep.versions:
            t = tensors[f]
            if t.is_inference():  # no version: equal to a candidate's None; no hole filled
                if v is not None:
                    return MISS
            elif v is MOVING:
                values.append(t._version)
            elif t._version != v:
                return MISS
        cuda = rep.cuda_call
        if cuda and self._is_capturing(tensors):  # capture sites: the full path
            return MISS
        with self.lock:
            j = self.journal
            statics = self.statics
            if (
                j is not rep.journal
                or self._cuda is not rep.devcopies
                or statics is not rep.statics
                or (statics is not None and statics.generation != rep.generation)
            ):
                return MISS
            stream = 0
            if cuda:
                import torch

                from kdump.record.flight.devcopy import current_stream

                stream = current_stream(torch.cuda.current_device())
            values += (index, time.time_ns())
            slot = j.reserve_from(rep.template, values, stream, index)
            if slot is None:
                return MISS
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
        self, slot: Slot, views: SpanViews, outputs: list[dict[str, Any]] = NO_OUTPUTS
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
        stop_reporting_to(self)
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


def process_block() -> dict[str, Any]:
    """The journal's process block: argv and the recorded environment (redacted)."""
    return {
        "argv": config.redact_argv(list(sys.argv)),
        "pid": os.getpid(),
        "env": config.recorded_environment(),
    }
