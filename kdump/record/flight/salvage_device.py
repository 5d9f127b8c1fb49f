"""Salvage's device side: a slot's gathered rows and payloads read back from the device tier.

The `<journal>.cuda<N>` dumps the salvage process wrote (kdump.record.flight.devring) hold, per
journal slot, the device twin (the payloads and the snapshot's call record, written before the
host copy ran) and, per gathered call, a device ring slot with the rows its kernel touched
(kdump.record.flight.gather). Everything is checked against the slot's seq and token before it
is used: a ring slot overwritten by later calls, or a twin holding another call, is never taken
for this call's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdump.format.journal import (
    CALL_RECORD,
    CALL_RECORD_BYTES,
    TRAILER_BYTES,
    SlotRecord,
    SlotState,
)
from kdump.record.flight import devring, gather
from kdump.record.flight.statics_reader import private_bytes


def read_dumps(files: dict[int, Path]) -> dict[int, devring.Dump | str]:
    """Each device tier read back, or why it cannot be used."""
    out: dict[int, devring.Dump | str] = {}
    for index, p in files.items():
        try:
            out[index] = devring.read_dump(Path(p))
        except devring.DeviceTierError as exc:
            out[index] = str(exc)
    return out


_RECORD = CALL_RECORD  # the snapshot's call record (snapshot.cu, Record)
_SLOT_HEAD = gather.SLOT_HEADER  # a device ring slot's header (snapshot.cu, SlotHead)


def device_rows(
    rec: SlotRecord, dumps: dict[int, devring.Dump | str]
) -> tuple[dict[int, bytes | Sparse], dict[str, Any] | None]:
    """The gathered storages of a slot rebuilt from the device tier: the touched rows' bytes
    (`Sparse`), or whole spans with the other rows zero-filled. (storage -> bytes, what the
    bundle says about it)."""
    assert rec.meta is not None
    dev = rec.meta.extra.get("device")
    if not isinstance(dev, dict) or "plan" not in dev:
        return {}, None
    try:
        plan = gather.Plan.from_json(dev["plan"])
    except ValueError as exc:
        return {}, {"missing": f"the slot's gather plan is damaged ({exc})"}
    facts: dict[str, Any] = {
        "storages": sorted(plan.storages),
        "rule": plan.rule,
        "rows": plan.rows,
    }
    dump = dumps.get(dev.get("device_index", -1))
    if not isinstance(dump, devring.Dump):
        why = dump or (
            dev.get("reason") and f"no salvage process held the device tier ({dev['reason']})"
        )
        facts["missing"] = why or "no device-tier dump next to the journal"
        return {}, facts
    whole = dev.get("whole")
    try:
        if whole is not None:
            return _whole_spans(rec, plan, whole, dump, facts)
        rows, pos, n = _check_device_slot(rec, plan, dump)
    except ValueError as exc:
        facts["missing"] = str(exc)
        return {}, facts
    import torch

    buffers = {i: bytearray(int(rec.meta.storages[i]["span_nbytes"])) for i in plan.storages}
    spans = {i: torch.frombuffer(b, dtype=torch.uint8) for i, b in buffers.items() if len(b)}
    # A replay that routed no token to this call gathers no row: `rows` is empty then.
    recs = private_bytes(rows).reshape(n, plan.rec_bytes)
    idx = gather.place_back(plan, recs, spans)
    facts.update(
        rows_kept=n,
        untouched_rows="zero-filled (the call cannot read them)",
        device_slot=pos,
    )
    # Only the touched rows' bytes are held (a sparse storage; the rest reads as zeros): a
    # decode step's A is a few rows of a buffer sized for the largest batch.
    ranges = gather.held_ranges(plan, idx, SPARSE_MAX_RANGES)
    if ranges is None:
        return {i: bytes(b) for i, b in buffers.items()}, facts
    out: dict[int, bytes | Sparse] = {}
    for i, b in buffers.items():
        view = memoryview(b)
        held = ranges.get(i, [])
        out[i] = Sparse(b"".join(view[lo:hi] for lo, hi in held), tuple(held))
    return out, facts


SPARSE_MAX_RANGES = 100_000  # per storage; a scattered row rule keeps its span whole instead


@dataclass(frozen=True)
class Sparse:
    """A gathered storage's touched bytes: `ranges` of the span, their bytes concatenated."""

    data: bytes
    ranges: tuple[tuple[int, int], ...]


def _whole_spans(
    rec: SlotRecord,
    plan: gather.Plan,
    whole: Any,
    dump: devring.Dump,
    facts: dict[str, Any],
) -> tuple[dict[int, bytes], dict[str, Any]]:
    """The torch fallback's slot: the plan's storages copied whole (ValueError: why not)."""
    if not isinstance(whole, list) or not all(
        isinstance(w, list) and len(w) == 3 and all(type(x) is int and x >= 0 for x in w)
        for w in whole
    ):
        raise ValueError("the slot's whole-copy layout is damaged")
    _, pos, _ = _check_device_slot(rec, plan, dump, rec_bytes=0)
    out: dict[int, bytes] = {}
    for storage, off, n in whole:
        if storage not in plan.storages or n != int(rec.meta.storages[storage]["span_nbytes"]):
            raise ValueError("the slot's whole-copy layout names other storages")
        try:
            out[storage] = dump.ring(pos + off, n)
        except devring.DeviceTierError as exc:
            raise ValueError(str(exc))
    facts.update(copied="whole (torch fallback: no row rule applied)", device_slot=pos)
    return out, facts


def earlier_host_copy(rec: SlotRecord) -> str | None:
    """Why a complete device-tier slot holds an earlier call's bytes, else None. Such a slot's
    payloads reach the host together with its call record, in stream order before `post`; a
    record of another seq means the copies that landed were the previous occupant's (the GPU
    ran them late, after the host had reused the slot for a new call)."""
    dev = rec.meta.extra.get("device") if rec.meta is not None else None
    if not isinstance(dev, dict) or "device_index" not in dev:
        return None  # no device tier: the host path's checksum covers the payloads
    if len(rec.call_record) != _RECORD.size:
        return None
    magic, _, seq, *_ = _RECORD.unpack(rec.call_record)
    if magic == gather.RECORD_MAGIC and seq != rec.seq:
        return f"its payloads are an earlier call's (call record of seq {seq}, slot seq {rec.seq})"
    return None


def _check_device_slot(
    rec: SlotRecord, plan: gather.Plan, dump: devring.Dump, rec_bytes: int | None = None
) -> tuple[bytes, int, int]:
    """The slot's rows in the device ring, verified to be this call's (ValueError: why not).
    `rec_bytes`: the record size the slot header must repeat (default: the plan's)."""
    if len(rec.call_record) != _RECORD.size:
        raise ValueError("the slot has no snapshot call record")
    magic, rows, seq, token, pos, _, _, complete, _, _ = _RECORD.unpack(rec.call_record)
    if magic != gather.RECORD_MAGIC or seq != rec.seq or complete != token or token == 0:
        raise ValueError("the snapshot of this call did not complete")
    if rec.token and token != rec.token:
        raise ValueError(f"the call record holds replay {token}, the slot replay {rec.token}")
    if pos == (1 << 64) - 1:
        raise ValueError("the snapshot gathered no rows")
    ring = dump.layout.ring_bytes
    newest = max(dump.head, dump.reserved_to)
    if newest > pos + ring:
        raise ValueError("its device ring slot was overwritten by later calls")
    try:
        head = dump.ring(pos, _SLOT_HEAD.size)
        hmagic, _, hseq, htoken, hpos, hrows, hrec, _, _, hcomplete = _SLOT_HEAD.unpack(head)
    except devring.DeviceTierError as exc:
        raise ValueError(str(exc))
    if (hmagic, hseq, htoken, hpos, hrows, hrec, hcomplete) != (
        gather.SLOT_MAGIC,
        seq,
        token,
        pos,
        rows,
        plan.rec_bytes if rec_bytes is None else rec_bytes,
        token,
    ):
        raise ValueError("its device ring slot holds another call (overwritten)")
    if rows > plan.rows:
        raise ValueError("its device ring slot claims more rows than the tensor has")
    try:
        data = dump.ring(pos + gather.SLOT_HEAD, rows * plan.rec_bytes)
    except devring.DeviceTierError as exc:
        raise ValueError(str(exc))
    return data, pos, rows


def from_twin(
    rec: SlotRecord, dumps: dict[int, devring.Dump | str], slot_bytes: int
) -> SlotRecord | None:
    """A slot in flight whose host copy had not run yet, completed from the device twin when
    the snapshot there finished (a crash right after it); None otherwise."""
    m = rec.meta
    if m is None or not rec.spans:
        return None
    dev = m.extra.get("device")
    if not isinstance(dev, dict):
        return None
    dump = dumps.get(dev.get("device_index", -1))
    if not isinstance(dump, devring.Dump):
        return None
    try:
        twin = dump.twin_slot(rec.index)
    except devring.DeviceTierError:
        return None
    at = slot_bytes - TRAILER_BYTES - CALL_RECORD_BYTES
    record = twin[at : at + CALL_RECORD_BYTES]
    magic, _, seq, token, _, _, _, complete, _, _ = _RECORD.unpack(record)
    pre = rec.markers[0]
    if magic != gather.RECORD_MAGIC or seq != rec.seq or complete != token or token == 0:
        return None
    if pre and token != pre:
        return None
    payloads = tuple(None if sp is None else twin[sp[0] : sp[0] + sp[1]] for sp in rec.spans)
    return SlotRecord(
        rec.index,
        SlotState.COMPLETE,
        seq=rec.seq,
        meta=m,
        payloads=payloads,
        reason="the host copy had not run: payloads from the device twin",
        # the done marker follows the kernel on its stream (for a graph site: the next snapshot
        # of its chain), the host copy runs beside it
        finished=rec.markers[2] == token,
        token=token,
        spans=rec.spans,
        markers=rec.markers,
        call_record=record,
        output_bytes=rec.output_bytes,  # written on the call's stream after the kernel: their
        out_marker=rec.out_marker,  # `out` says whether they are this token's
    )
