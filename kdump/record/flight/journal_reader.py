"""The flight recorder's journal read back: a file in, typed records out (kdump.format.journal).

The reader never trusts the file: a file that is not a journal raises JournalError; damaged or
truncated slots read as torn, each with the reason. The states and what the markers mean are in
kdump.format.journal's docstring (and docs/FORMAT.md).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from kdump.format import journal as layout
from kdump.format.journal import (
    JournalContents,
    JournalError,
    SlotMeta,
    SlotRecord,
    SlotState,
    SlotTorn,
    check_spans,
    parse_file_header,
    parse_meta,
)


def read_journal(path: str | os.PathLike[str]) -> JournalContents:
    """Read a journal file. A file that is not a journal raises JournalError; damaged or
    truncated slots read as torn."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise JournalError(f"{p}: no such journal file")
    except IsADirectoryError:
        raise JournalError(f"{p} is a directory; give a journal file")
    except OSError as exc:
        raise JournalError(f"{p}: cannot read ({exc.strerror})")
    header = parse_file_header(raw, p)
    records = []
    for i in range(header.slot_count):
        base = header.header_bytes + i * header.slot_bytes
        records.append(read_slot(raw, base, header.slot_bytes, i, header.version))
    records.sort(key=_newest_first)
    return JournalContents(p, header, records)


def _newest_first(r: SlotRecord) -> tuple[int, int, int]:
    group = 2 if r.state is SlotState.EMPTY else (1 if r.seq == 0 else 0)
    return (group, -r.seq, r.index)


def read_pid(path: str | os.PathLike[str]) -> int:
    """The recording process' pid from a journal's header (JournalError when not a journal)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(layout.PAGE + layout.MAX_PROCESS_JSON)
    except OSError as exc:
        raise JournalError(f"{p}: cannot read ({exc.strerror}); give a journal file or folder")
    return parse_file_header(raw, p, whole=False).pid


@dataclass(frozen=True)
class _Body:
    """A slot's header, payload table and JSON, checked: what its trailer is then read against."""

    meta: SlotMeta
    end: int  # where the JSON ends, from the slot's start
    spans: list[tuple[int, int]]  # the payload table as written
    present: list[bool]  # per payload: whether it holds bytes
    placed: tuple[tuple[int, int] | None, ...]  # per storage: its span when present
    outs: tuple[bytes | None, ...]  # per output: its payload's bytes when present


def read_slot(raw: bytes, base: int, slot_bytes: int, index: int, version: int) -> SlotRecord:
    """Slot `index` (at offset `base` of `raw`) as read back: empty, torn (with why), in flight
    or complete."""
    if base + slot_bytes > len(raw):
        if base >= len(raw) or not any(raw[base:]):
            return SlotRecord(index, SlotState.TORN, reason="file truncated before this slot")
        return SlotRecord(index, SlotState.TORN, reason="file truncated inside this slot")
    fixed = raw[base : base + layout.SLOT_FIXED.size]
    magic, _, seq = layout.SLOT_FIXED.unpack(fixed)[:3]
    t = base + slot_bytes - layout.TRAILER.size
    if magic != layout.SLOT_MAGIC:
        if magic == bytes(4) and raw[t : t + 4] == bytes(4):
            return SlotRecord(index, SlotState.EMPTY)
        return SlotRecord(index, SlotState.TORN, reason="slot header has no valid magic")
    try:
        body = _read_body(raw, base, slot_bytes, fixed, version)
    except SlotTorn as exc:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason=str(exc))
    return _with_trailer(raw, base, t, index, seq, body, version)


def _read_body(raw: bytes, base: int, slot_bytes: int, fixed: bytes, version: int) -> _Body:
    """The slot's header checked against its CRC, its JSON parsed and its payload table checked
    (SlotTorn: why not)."""
    (_, flags, _, call_index, target_id, k, stream, capture, graph, replay, jlen) = (
        layout.SLOT_FIXED.unpack(fixed)
    )
    body_end = layout.SLOT_HEAD + 16 * k + jlen
    if k > slot_bytes // 16 or body_end > slot_bytes - layout.TRAILER.size:
        raise SlotTorn("slot header lengths run past the slot")
    (hcrc,) = layout.SLOT_CRC.unpack_from(raw, base + layout.SLOT_FIXED.size)
    body = raw[base + layout.SLOT_HEAD : base + body_end]
    if hcrc != zlib.crc32(body, zlib.crc32(fixed)):
        raise SlotTorn("slot header checksum mismatch")
    spans = [layout.TABLE_ENTRY.unpack_from(body, 16 * j) for j in range(k)]
    ids = (stream, capture, graph, replay)
    meta, present = parse_meta(body[16 * k :], flags, call_index, target_id, k, ids)
    if meta.outputs and version < 4:
        raise SlotTorn(f"a version-{version} slot names outputs")
    check_spans(
        spans, present, meta, body_end, slot_bytes - layout.TRAILER.size - layout.CALL_RECORD_BYTES
    )
    n_in = len(meta.storages)
    placed_all = [(int(o), int(n)) if ok else None for (o, n), ok in zip(spans, present)]
    outs = tuple(
        None if sp is None else raw[base + sp[0] : base + sp[0] + sp[1]] for sp in placed_all[n_in:]
    )
    return _Body(meta, body_end, spans, present, tuple(placed_all[:n_in]), outs)


def _with_trailer(
    raw: bytes, base: int, t: int, index: int, seq: int, b: _Body, version: int
) -> SlotRecord:
    """The slot's state from its trailer (at offset `t` of `raw`), given its checked body."""
    tmagic, tflags, tseq, tcrc, pre, post, done, out = layout.TRAILER.unpack_from(raw, t)
    meta = b.meta
    if tmagic == layout.REFILL_MAGIC:
        if tseq == seq and tflags == 0 and tcrc == 0 and not (pre or post or done or out):
            return SlotRecord(
                index, SlotState.IN_FLIGHT, seq=seq, meta=meta, spans=b.placed, output_bytes=b.outs
            )
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="refill began over this call")
    if tmagic != layout.TRAILER_MAGIC:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="trailer is damaged")
    if tseq != seq:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="trailer seq differs")
    known = layout.TRAILER_FLAG_PAYLOAD_CRC | layout.TRAILER_FLAG_DEVICE
    # version 3 kept the `out` marker's bytes zero too
    pad = raw[t + 20 : t + 24] + raw[t + (48 if version < 4 else 56) : t + layout.TRAILER.size]
    if out and not meta.outputs:  # only a slot with outputs has an `out` marker
        pad += b"\x01"
    if tflags & ~known or any(pad) or tflags == known:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="trailer has unknown bits set")
    n_in = len(meta.storages)
    crc = zlib.crc32(raw[base : base + b.end])
    if tflags & layout.TRAILER_FLAG_PAYLOAD_CRC:  # the storages' payloads (outputs come later)
        for (off, n), ok in zip(b.spans[:n_in], b.present):
            if ok:
                crc = zlib.crc32(raw[base + off : base + off + n], crc)
    if crc != tcrc:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="slot checksum mismatch")
    read = SlotRecord(
        index,
        SlotState.IN_FLIGHT,
        seq=seq,
        meta=meta,
        token=post,
        spans=b.placed,
        markers=(pre, post, done),
        call_record=raw[t - layout.CALL_RECORD_BYTES : t],
        output_bytes=b.outs,
        out_marker=out,
    )
    if post == 0 or pre != post:
        why = "payloads not copied yet" if post == 0 else "payloads were being rewritten"
        return replace(read, reason=why)
    if done > post:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="done marker is ahead of post")
    payloads = tuple(
        raw[base + off : base + off + n] if ok else None
        for (off, n), ok in zip(b.spans[:n_in], b.present)
    )
    return replace(read, state=SlotState.COMPLETE, payloads=payloads, finished=done == post)
