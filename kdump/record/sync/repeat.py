"""The sync recorder's exact-repeat path: a small CPU call made again with tensors of the same
addresses, layouts and aliasing (the same objects, or others with the same facts) and the same
argument values as a call before it writes a bundle that differs from that call's only in
per-call facts (the meta, the creation time) and in the blobs' bytes and digests.

Such a call skips the argument encoding, the capture records, the manifest and the template's
fills: its spans are compared with the previous call's snapshot held in buffers of the repeat
(a span that did not change keeps its digests, one that did is copied and hashed again), and the
header is the previous one's form with the digests and the meta put in. Whatever does not fit
(another blob pattern, a return value, an exception, another env) goes the ordinary way.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kdump.bundle import bytecmp
from kdump.bundle import writer as _writer
from kdump.bundle.capture import Captured
from kdump.bundle.fileio import cpu_view
from kdump.bundle.manifest import RepeatForm
from kdump.bundle.manifest import encode_json as _encode
from kdump.bundle.manifest import escaped as _escaped
from kdump.bundle.store import blob_digests
from kdump.bundle.tensors import layout_facts
from kdump.format.argtree import LIMITS
from kdump.format.records import MAX_HEADER, Source
from kdump.record.repeat import Seen

if TYPE_CHECKING:
    from kdump.bundle.capture import CallRecord

Digests = tuple[str, str]
_memmove = ctypes.memmove
_PADS = tuple(b" " * n for n in range(8))


class _Buffer:
    """A snapshot buffer of one span, with the digests of what it holds (None: not yet known)."""

    __slots__ = ("data", "digests", "n", "ptr", "view")

    def __init__(self, n: int) -> None:
        import torch

        self.data = torch.empty(n, dtype=torch.uint8)
        self.ptr = self.data.data_ptr() if n else 0
        self.view = cpu_view(self.data)
        self.n = n
        self.digests: Digests | None = None

    def holds(self, ptr: int) -> bool:
        """Whether the buffer holds the n bytes at `ptr`."""
        return bytecmp.same(self.ptr, ptr, self.n)

    def take(self, ptr: int) -> None:
        """Snapshot the n bytes at `ptr` (digests kept when they are the same bytes)."""
        if not self.holds(ptr):
            _memmove(self.ptr, ptr, self.n)
            self.digests = None

    def digest(self) -> Digests:
        if self.digests is None:
            self.digests = blob_digests(self.view)
        return self.digests


@dataclass
class SyncRepeat:
    """What an exact repeat of one recorded call needs (`make`); used by one call at a time (the
    recorder takes it out of its table while a call uses it)."""

    key: Any  # the call's repeat key (kdump.record.repeat)
    checks: tuple[tuple[int, int], ...]  # (tensor index, storage bytes) of each storage
    names: Any  # the hook's positional names at the call
    env: dict[str, Any]  # the env object its bundle was written with
    call: CallRecord  # the recorded call (its trees and records are reused; never edited)
    spans: tuple[int, ...]  # address of each input span
    inputs: tuple[_Buffer, ...]
    outputs: tuple[tuple[int, int, _Buffer], ...]  # (address, input storage or -1, own buffer)
    pattern: tuple[int, ...]  # blob of each storage (inputs, then outputs), as the header has
    form: RepeatForm
    left: tuple[tuple[object, ...], ...]  # layout facts of the call's tensors after it returned
    pid: int  # the process that learned it

    def left_as(self, tensors: Sequence[Any]) -> bool:
        """Whether the call left `tensors` with the facts the learned call left them with: then
        the outputs' records and spans (and the addresses their bytes are read at) are the
        learned ones."""
        return len(tensors) == len(self.left) and all(
            layout_facts(t) == f for t, f in zip(tensors, self.left)
        )

    def matches(self, names: Any, tensors: Sequence[Any]) -> bool:
        """Whether `tensors` (of a call with an equal key: the same addresses, layouts and
        aliasing) are CPU tensors whose storages have the recorded sizes: then their records are
        the recorded ones, whether or not they are the same objects (a view made again for each
        call is another object with the same facts)."""
        if names != self.names:
            return False
        for t in tensors:
            if not t.is_cpu:  # the key leaves the device out where the address tells it
                return False
        return all(tensors[i].untyped_storage().nbytes() == n for i, n in self.checks)

    def take_inputs(self) -> None:
        for ptr, buf in zip(self.spans, self.inputs):
            buf.take(ptr)

    def inputs_captured(self) -> Captured:
        """The inputs just taken as a capture, for the ordinary path (written before the next
        call of this repeat: the buffers are not copied)."""
        cap = self.call.inputs
        return Captured(
            list(cap.storages),
            list(cap.tensors),
            [b.data for b in self.inputs],
            [b.digests for b in self.inputs],
        )

    def blobs(self) -> tuple[list[Digests], list[memoryview]] | None:
        """After the call: the outputs taken (an unchanged output shares its input's snapshot,
        as `capture` does), and the bundle's blobs in header order; None when the blobs do not
        fall into the recorded pattern (the ordinary path writes that bundle)."""
        bufs = list(self.inputs)
        for ptr, j, own in self.outputs:
            if j >= 0 and self.inputs[j].holds(ptr):
                bufs.append(self.inputs[j])
            else:
                own.take(ptr)
                bufs.append(own)
        order: dict[str, int] = {}
        digests: list[Digests] = []
        views: list[memoryview] = []
        pattern = []
        for b in bufs:
            dig = b.digest()
            u = order.get(dig[0])
            if u is None:
                u = order[dig[0]] = len(digests)
                digests.append(dig)
                views.append(b.view)
            pattern.append(u)
        if tuple(pattern) != self.pattern:
            return None
        return digests, views

    def bundle(self, meta: dict[str, Any]) -> bytes | None:
        """The bundle file's bytes for the call whose inputs were taken (its outputs are taken
        here); None where its blobs or its meta need the ordinary path (a string to cut) or the
        header is too large."""
        got = self.blobs()
        if got is None:
            return None
        digests, views = got
        text = _encode(meta)
        if len(text) > LIMITS.max_string:
            return None
        raw = self.form.text(_writer._utc_now(), digests, _escaped(text))
        pad = -(8 + len(raw)) % 8
        if len(raw) + pad > MAX_HEADER:
            return None
        return b"".join([struct.pack("<Q", len(raw) + pad), raw, _PADS[pad], *views])


def write(path: str, data: bytes) -> None:
    """Write a bundle file as the writer does (one atomic write)."""
    _writer.atomic_write(path, data)


def make(
    seen: Seen,
    names: Any,
    env: dict[str, Any],
    call: CallRecord,
    header: bytes,
    digests: Sequence[Digests],
    form: RepeatForm | None,
    created: str,
    inline_below: int,
) -> SyncRepeat | None:
    """The repeat of `call` (just written with `header`, its storages' `digests` in capture
    order, `created` its creation time), whose `repeat_key` gave `seen`; None for a call this
    path does not write: one with device tensors, a return value, lazy conj / neg views,
    storages of other sources or of `inline_below` bytes or more (those go to the store), or a
    form that does not give its header byte for byte."""
    key, tensors = seen
    if form is None or call.returned is not None or call.outputs is None:
        return None
    if any(t.is_conj() or t.is_neg() for t in tensors):
        return None
    caps = (call.inputs, call.outputs)
    for cap in caps:
        for st in cap.storages:
            if (
                st.device != "cpu"
                or st.source is not Source.BLOB
                or st.stats is not None
                or st.ranges
                or st.generator is not None
                or st.span_nbytes >= inline_below
            ):
                return None
    firsts: dict[int, int] = {}
    for k, rec in enumerate(call.inputs.tensors):
        firsts.setdefault(rec.storage, k)
    checks = tuple((firsts[i], st.storage_nbytes) for i, st in enumerate(call.inputs.storages))
    spans = tuple(st.base_ptr + st.span_start for st in call.inputs.storages)
    at = {
        (st.base_ptr, st.span_start, st.span_nbytes): i
        for i, st in reversed(list(enumerate(call.inputs.storages)))
    }
    inputs = tuple(_Buffer(st.span_nbytes) for st in call.inputs.storages)
    outputs = tuple(
        (
            st.base_ptr + st.span_start,
            at.get((st.base_ptr, st.span_start, st.span_nbytes), -1),
            _Buffer(st.span_nbytes),
        )
        for st in call.outputs.storages
    )
    # The buffers start with the recorded call's bytes, whose digests the bundle named.
    bufs = [*inputs, *(own for _, _, own in outputs)]
    datas = [*call.inputs.data, *call.outputs.data]
    if len(digests) != len(bufs) or len(datas) != len(bufs):
        return None

    order: dict[str, int] = {}
    for buf, data, dig in zip(bufs, datas, digests):
        if data.numel() != buf.n:
            return None
        if buf.n:
            _memmove(buf.ptr, data.data_ptr(), buf.n)
        buf.digests = dig
        order.setdefault(dig[0], len(order))
    rep = SyncRepeat(
        key=key,
        checks=checks,
        names=names,
        env=env,
        call=call,
        spans=spans,
        inputs=inputs,
        outputs=outputs,
        pattern=tuple(order[d[0]] for d in digests),
        form=form,
        left=tuple(layout_facts(t) for t in tensors),
        pid=os.getpid(),
    )
    # The form must give the header just written, from this call's own facts.
    unique = list({d[0]: d for d in digests}.values())
    if rep.form.render(created, unique, _escaped(_encode(call.meta))) != header:
        return None
    return rep
