"""Salvage: turn a dead process' flight-recorder journal into bundles.

Each complete slot becomes one .kdump bundle (newest first), written through the public bundle
API and read back before it counts, so a damaged slot can never become a corrupt bundle. Slots in
flight at the crash are reported with their metadata only; torn slots with why. Storages whose
bytes the journal lacks (bulky inputs, outputs, what did not fit a slot) keep their layouts with
storage source `missing` (docs/FORMAT.md); their tensors are listed under
`journal.missing_tensors` in the call's meta. Static operands (kdump.record.flight.statics) come
from the static region next to the journal: complete copies become blobs of the folder's shared
store (one copy for every bundle), the others `by-reference` with their statistics
(`journal.by_reference_tensors`; `journal.statics` says which and why). Rows the device tier
gathered come from the `<journal>.cuda<N>` dumps (kdump.record.flight.devring).

Outputs the recorder copied after the call (journal version 4, `--outputs`) become the bundle's
`outputs`, as the sync recorder writes them: a storage snapshot after the call per output
storage and (input tensor, output tensor) `inplace` pairs, every output tensor the slot held
(one written with the bytes it held is production's result too); `meta.journal.outputs` counts
those the call changed, where their bytes before the call are held to tell. Those the slot
could not hold are listed in `meta["outputs_not_kept"]`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kdump.errors import BundleError
from kdump.format.journal import (
    CALL_RECORD_BYTES,
    FILE_PREFIX,
    RUN_PREFIX,
    TRAILER_BYTES,
    JournalContents,
    JournalError,
    SlotRecord,
    SlotState,
)
from kdump.progress import Bar
from kdump.record.flight import devring, gather
from kdump.record.flight.announce import dump_paths, pid_alive
from kdump.record.flight.journal_reader import read_journal, read_pid
from kdump.record.flight.statics import (
    Region,
    private_bytes,
    read_region,
    region_path,
    salvaged_storage,
)

REPORT_SUFFIX = "-salvage.json"
CRASH_SUFFIX = ".crash.json"  # next to a journal: the recorded process' last words
RAISED_SUFFIX = ".raised.jsonl"  # next to a journal: one line per recorded call that raised


def raised_path(journal: str | os.PathLike[str]) -> Path:
    p = Path(journal)
    return p.with_name(p.name + RAISED_SUFFIX)


def read_raised(journal: str | os.PathLike[str]) -> dict[tuple[int, int], str]:
    """(slot, seq) -> the exception of each recorded call that raised. Lines that do not parse
    (a write cut short) are skipped: the call's slot still salvages, as not finished."""
    out: dict[tuple[int, int], str] = {}
    try:
        text = raised_path(journal).read_bytes()[-(1 << 22) :].decode("utf-8", "replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            d = json.loads(line)
            key = (int(d["slot"]), int(d["seq"]))
            out[key] = str(d["exception"])
        except (ValueError, TypeError, KeyError):
            continue
    return out


@dataclass(frozen=True)
class SalvageResult:
    journal: Path
    bundles: list[Path]  # newest first
    in_flight: list[SlotRecord]  # metadata only
    torn: list[SlotRecord]
    report: Path  # JSON summary next to the bundles


def salvage(
    journal_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    crash_context: dict[str, Any] | None = None,
) -> list[Path]:
    """Write every complete slot of the journal as a bundle in `out_dir`, then remove the journal.
    `crash_context` (exit code or signal, stderr tail, traceback) goes into each call's meta."""
    return salvage_journal(journal_path, out_dir, crash_context).bundles


def salvage_journal(
    journal_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    crash_context: dict[str, Any] | None = None,
    *,
    remove: bool = True,
    device_dumps: dict[int, Path] | None = None,
    progress: Bar | None = None,
    written: dict[Path, Any] | None = None,
) -> SalvageResult:
    """`device_dumps`: the device tiers by device index (default: the `<journal>.cuda<N>` files
    next to the journal, written by the salvage process); `progress` is advanced per call
    written (its total grows by this journal's calls). `written`: kept by the caller across
    salvages of one live journal (flushes): a bundle whose slot is unchanged since an earlier
    salvage wrote it (same seq, markers and context) is not written again."""
    contents = read_journal(journal_path)
    dump_files = dump_paths(contents.path) if device_dumps is None else device_dumps
    dumps = _read_dumps(dump_files)
    last_words = contents.path.with_name(contents.path.name + CRASH_SUFFIX)
    try:  # what the recorded process wrote when an exception ended it
        said = json.loads(last_words.read_text())
        if isinstance(said, dict):
            crash_context = {**(crash_context or {}), **said}
    except (OSError, ValueError):
        pass
    raised = read_raised(contents.path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = contents.header
    torn = contents.having(SlotState.TORN)
    bundles: list[Path] = []
    complete = contents.having(SlotState.COMPLETE)
    kept_in_flight = []
    for rec in contents.having(SlotState.IN_FLIGHT):
        try:
            recovered = _from_twin(rec, dumps, contents.header.slot_bytes)
        except Exception:  # metadata it cannot use: the slot stays in flight
            recovered = None
        if recovered is not None:
            complete.append(recovered)
        else:
            kept_in_flight.append(rec)
    complete.sort(key=lambda r: -r.seq)
    by_seq = {r.seq: r for r in complete}
    died_at = _died_at(complete, kept_in_flight, crash_context)
    names = sorted(
        f"journal-{head.pid}-call-{r.meta.call_index:06d}-seq{r.seq}.kdump"
        for r in complete
        if r.seq in died_at
    )
    region = read_region(contents.path)  # static operands copied once (kdump.record.flight.statics)
    if progress is not None:
        progress.total = (progress.total or 0) + len(complete)
    # A later copy into the static region can fill a weight an older bundle held by reference.
    statics = tuple((e.index, e.seq, e.copied) for e in region.entries) if region else ()
    for rec in complete:
        if progress is not None and rec is not complete[0]:
            progress.advance()  # the call before this one is written
        stale = _earlier_host_copy(rec)
        if stale is not None:
            torn.append(SlotRecord(rec.index, SlotState.TORN, rec.seq, rec.meta, (), stale))
            continue
        path = out / f"journal-{head.pid}-call-{rec.meta.call_index:06d}-seq{rec.seq}.kdump"
        site = rec.meta.extra.get("site") if rec.meta.capture_id else None
        eager = site.get("eager_seq") if isinstance(site, dict) else None
        before = by_seq.get(eager) if type(eager) is int else None
        context = _call_crash(crash_context, rec.seq in died_at, names)
        state = (
            (rec.index, rec.seq, rec.markers, rec.finished, rec.out_marker),
            _state(before),
            statics,
            repr(context),
            raised.get((rec.index, rec.seq)),
        )
        if written is not None and written.get(path) == state and path.exists():
            bundles.append(path)
            continue
        try:
            _write_bundle(path, rec, contents, context, before, dumps, region, raised)
        except Exception as exc:
            # Checksums held but the content is unusable (any error: one slot's metadata must
            # not lose the other slots): report it, never keep the file.
            path.unlink(missing_ok=True)
            torn.append(SlotRecord(rec.index, SlotState.TORN, rec.seq, rec.meta, (), str(exc)))
            continue
        bundles.append(path)
        if written is not None:
            written[path] = state
    if progress is not None and complete:
        progress.advance()
    if region is not None:
        region.close()
    in_flight = kept_in_flight
    report = out / f"journal-{head.pid}{REPORT_SUFFIX}"
    _write_report(report, contents, bundles, in_flight, torn, crash_context, dumps)
    if remove:
        contents.path.unlink(missing_ok=True)
        last_words.unlink(missing_ok=True)
        raised_path(contents.path).unlink(missing_ok=True)
        region_path(contents.path).unlink(missing_ok=True)
        for p in dump_files.values():
            Path(p).unlink(missing_ok=True)
    return SalvageResult(contents.path, bundles, in_flight, torn, report)


# Keys of a crash context that say the process died (a flush from a live process has none).
_DEATH = ("signal", "cuda_error", "exception", "traceback")


def _died(crash_context: dict[str, Any] | None) -> bool:
    if not crash_context or crash_context.get("flushed"):
        return False
    code = crash_context.get("exit_code")
    return any(k in crash_context for k in _DEATH) or (isinstance(code, int) and code != 0)


def _died_at(
    complete: list[SlotRecord], in_flight: list[SlotRecord], crash_context: dict[str, Any] | None
) -> set[int]:
    """The seqs of the calls a process that died may have died at: the last recorded call on
    each stream (a CUDA graph's sites: the last of each graph) and every call still in flight."""
    if not _died(crash_context):
        return set()
    last: dict[tuple[str, int], int] = {}
    for r in [*complete, *in_flight]:
        if r.meta is None:
            continue
        key = ("graph", r.meta.graph_id) if r.meta.capture_id else ("stream", r.meta.stream)
        last[key] = max(last.get(key, -1), r.seq)
    return (
        set(last.values())
        | {r.seq for r in in_flight}
        | {r.seq for r in complete if not r.finished}
    )


def _call_crash(
    crash_context: dict[str, Any] | None, here: bool, names: list[str]
) -> dict[str, Any] | None:
    """One call's crash context: whether the process may have died at this call, and which of
    its bundles hold such calls."""
    if not _died(crash_context):
        return crash_context
    assert crash_context is not None
    return {**crash_context, "at_this_call": here, "crashed_at": names}


def _state(rec: SlotRecord | None) -> tuple[Any, ...] | None:
    return None if rec is None else (rec.index, rec.seq, rec.markers, rec.finished, rec.out_marker)


def _slot_facts(rec: SlotRecord) -> dict[str, Any]:
    m = rec.meta
    facts: dict[str, Any] = {"slot": rec.index, "seq": rec.seq}
    if m is not None:
        facts.update(
            call_index=m.call_index,
            target=m.target,
            target_id=m.target_id,
            stream=m.stream,
            capture_id=m.capture_id,
            graph_id=m.graph_id,
            after_kernel=m.after_kernel,
        )
        if m.capture_id:  # a graph's slot: the markers count the graph's replays
            site = m.extra.get("site")
            site = site if isinstance(site, dict) else {}
            facts.update(graph=m.capture_id, replay=rec.token, site=site.get("position"))
    if rec.state is SlotState.COMPLETE:
        facts["finished"] = rec.finished
        facts["in_flight"] = not rec.finished  # the kernel had not finished when it died
        if rec.reason:
            facts["note"] = rec.reason
    elif rec.reason:
        facts["reason"] = rec.reason
    return facts


def _write_bundle(
    path: Path,
    rec: SlotRecord,
    contents: JournalContents,
    crash_context: dict[str, Any] | None,
    before: SlotRecord | None = None,
    dumps: dict[int, devring.Dump | str] | None = None,
    region: Region | None = None,
    raised: dict[tuple[int, int], str] | None = None,
) -> None:
    """One bundle of slot `rec`. A graph replay's slot whose site kept the eager call made on
    the same buffers before capture is written as two calls: that call (what the graph was
    captured over), then the replay's values, so a graph replay of call 0 replays the
    production sequence (`--then`-style phases come from the bundle's later calls)."""
    from kdump.bundle import load_bundle, save_calls
    from kdump.bundle.store import BlobStore
    from kdump.format.records import Where

    calls = [_call_record(rec, contents, crash_context, dumps, region, raised)]
    if before is not None:
        first = _call_record(before, contents, crash_context, dumps, region, raised)
        first.meta["journal"]["role"] = "before capture (the graph's buffers then)"
        calls.insert(0, first)
    info = {
        "salvaged_from": str(contents.path),
        "journal_created": contents.header.created,
        "process": contents.header.process,
    }
    facts = calls[-1].meta["journal"]
    if "graph" in facts:
        info["graph_replay"] = {
            "graph": facts["graph"],
            "replay": facts["replay"],
            "site": facts["site"],
            "capture_call": 0,
            "replay_call": len(calls) - 1,
        }
    # Weights from the static region go to the folder's blob store: one copy for all bundles.
    shared = any(c.meta["journal"].get("static_blobs") for c in calls)
    save_calls(path, calls, info=info, store=BlobStore(path.parent) if shared else None)
    with load_bundle(path) as bundle:  # what salvage leaves behind must load and verify
        known = region.verified if region is not None else set()
        bundle.verify(known_good=known)
        if shared:  # the store's blobs (weights) need no second check in this salvage
            known.update(sha for sha, b in bundle.blobs.items() if b.where is Where.STORE)


def _call_record(
    rec: SlotRecord,
    contents: JournalContents,
    crash_context: dict[str, Any] | None,
    dumps: dict[int, devring.Dump | str] | None = None,
    region: Region | None = None,
    raised: dict[tuple[int, int], str] | None = None,
) -> Any:
    import torch

    from kdump.bundle import (
        CallRecord,
        Captured,
        Source,
        StorageRecord,
        TensorRecord,
    )

    meta = rec.meta
    assert meta is not None  # complete slots always carry their metadata
    rows, device_facts = _device_rows(rec, dumps or {})
    payloads = [rows[i] if p is None and i in rows else p for i, p in enumerate(rec.payloads)]
    storages, data, statics, digests = [], [], [], []
    for j, (s, payload) in enumerate(zip(meta.storages, payloads)):
        ranges: tuple[tuple[int, int], ...] = ()
        sparse = isinstance(payload, Sparse)
        if isinstance(payload, Sparse):
            payload, ranges = payload.data, payload.ranges
        got = salvaged_storage(s, payload, region)
        digests.append(got.digests)
        storages.append(
            StorageRecord(
                device=str(s["device"]),
                base_ptr=int(s["base_ptr"]),
                storage_nbytes=int(s["storage_nbytes"]),
                span_start=int(s["span_start"]),
                span_nbytes=int(s["span_nbytes"]),
                source=Source.SPARSE if sparse else got.source,
                stats=got.stats,
                ranges=ranges,
            )
        )
        data.append(got.data if got.data is not None else torch.empty(0, dtype=torch.uint8))
        if got.static:
            statics.append({"storage": j, "source": got.source.value, "why": got.note})
    tensors, missing, by_ref = [], [], []
    for i, t in enumerate(meta.tensors):
        tensors.append(
            TensorRecord(
                storage=int(t["storage"]),
                dtype=str(t["dtype"]),
                shape=tuple(int(x) for x in t["shape"]),
                stride=tuple(int(x) for x in t["stride"]),
                storage_offset=int(t["storage_offset"]),
                requires_grad=bool(t.get("requires_grad", False)),
                data_ptr=int(t.get("data_ptr", 0)),
            )
        )
        source = storages[int(t["storage"])].source
        if source is Source.MISSING:
            missing.append(i)
        elif source is Source.BY_REFERENCE:
            by_ref.append(i)
    journal_meta = _slot_facts(rec)
    exception = (raised or {}).get((rec.index, rec.seq))
    if exception is not None and rec.state is SlotState.COMPLETE and not rec.finished:
        # it returned by raising: not a kernel cut short by the process' end
        journal_meta.update(in_flight=False, raised=True)
    if missing:
        journal_meta["missing_tensors"] = missing
    if by_ref:  # static operands without their bytes: re-created from their statistics
        journal_meta["by_reference_tensors"] = by_ref
    if statics:  # which storages the static region gave, or why it could not
        journal_meta["statics"] = statics
        journal_meta["static_blobs"] = sum(s["source"] == "blob" for s in statics)
    if device_facts is not None:
        journal_meta["device"] = device_facts
    call_meta = dict(meta.extra)
    call_meta.pop("outputs", None)  # the slot's layout of them: the bundle's `outputs` say it
    call_meta["journal"] = journal_meta
    call_meta["process"] = {"pid": contents.header.pid, "host": contents.header.host}
    if crash_context is not None:
        call_meta["crash"] = crash_context
    if journal_meta.get("raised"):
        call_meta["exception"] = exception  # as the sync recorder records it
    call = CallRecord(
        target=meta.target,
        called_as=meta.called_as,
        args=meta.args,
        kwargs=meta.kwargs,
        names=meta.names,
        inputs=Captured(storages=storages, tensors=tensors, data=data, digests=digests),
        meta=call_meta,
    )
    if meta.outputs:
        _attach_outputs(call, rec)
    return call


def _attach_outputs(call: Any, rec: SlotRecord) -> None:
    """The slot's post-call payloads as the call's outputs (`kdump.bundle.writer.
    attach_outputs`'s form), and what the bundle says about those it lacks."""
    import torch

    from kdump.bundle import Captured, Source, StorageRecord

    meta = rec.meta
    assert meta is not None
    facts = call.meta["journal"]
    if not rec.outputs_held:
        # The copies after the call did not complete for this call (or this replay): it raised,
        # was still running, or a later replay was refreshing them when the process died.
        facts["outputs"] = "not copied after this call (it had not returned)"
        return
    storages, data, inplace, kept_tensors = [], [], [], []
    unplaced: list[int] = []
    changed_any = unchanged = 0
    for o, got in zip(meta.outputs, rec.output_bytes):
        j = int(o["storage"])
        if got is None:  # it did not fit the slot beside the header after all
            unplaced += o["tensors"]
            continue
        s = call.inputs.storages[j]
        before = call.inputs.data[j] if s.source is Source.BLOB else None
        post = torch.frombuffer(bytearray(got), dtype=torch.uint8)
        changed = [i for i in o["tensors"] if _changed(call.inputs.tensors[i], s, before, post)]
        unchanged += len(o["tensors"]) - len(changed)
        changed_any += len(changed)
        # Every output kept, as sync mode keeps them: one the call wrote with the bytes it held
        # (a stale result, a serving loop's buffer) still tells the replay what production saw.
        # The bundle stores an unchanged span once (content de-duplication).
        changed = list(o["tensors"])
        k = len(storages)
        storages.append(
            StorageRecord(
                device=s.device,
                base_ptr=s.base_ptr,
                storage_nbytes=s.storage_nbytes,
                span_start=s.span_start,
                span_nbytes=s.span_nbytes,
            )
        )
        data.append(post)
        for i in changed:
            inplace.append((i, len(kept_tensors)))
            kept_tensors.append(dataclasses.replace(call.inputs.tensors[i], storage=k))
    if unplaced:
        _not_kept(call, meta, unplaced, rec)
    facts["outputs"] = {"kept": len(kept_tensors), "changed": changed_any, "unchanged": unchanged}
    if not kept_tensors:
        return
    call.outputs = Captured(storages=storages, tensors=kept_tensors, data=data)
    call.inplace = inplace
    call.returned = None


def _changed(t: Any, s: Any, before: Any, post: Any) -> bool:
    """Whether tensor record `t` (of storage `s`) covers bytes the call changed; True where its
    bytes before the call are not held (nothing to compare with)."""
    if before is None or len(before) != len(post):
        return True
    lo, hi = t.byte_extent()
    lo, hi = max(lo - s.span_start, 0), min(hi - s.span_start, len(post))
    return hi > lo and not torch_equal(before[lo:hi], post[lo:hi])


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _not_kept(call: Any, meta: Any, tensors: list[int], rec: SlotRecord) -> None:
    """Add output tensors the slot could not place to `meta["outputs_not_kept"]`."""
    from kdump.bundle import argtree

    paths = argtree.tensor_paths(meta.names, meta.args, meta.kwargs)
    said = call.meta.get("outputs_not_kept")
    said = dict(said) if isinstance(said, dict) else {"tensors": [], "bytes": 0}
    sizes = [int(s["span_nbytes"]) for s in meta.storages]
    lost = {int(meta.tensors[i]["storage"]) for i in tensors}
    said["tensors"] = list(said.get("tensors", [])) + [
        paths[i] if i < len(paths) else f"tensor{i}" for i in tensors
    ]
    said["bytes"] = int(said.get("bytes", 0)) + sum(sizes[j] for j in lost)
    # the smallest power of two whose payload share holds every storage before the call and
    # these outputs after it
    need = sum(sizes) + sum(sizes[j] for j in lost)
    size = 4096
    while size * 0.9 < need:
        size *= 2
    said["slot_bytes"] = max(int(said.get("slot_bytes", 0)), size)
    call.meta["outputs_not_kept"] = said


def _read_dumps(files: dict[int, Path]) -> dict[int, devring.Dump | str]:
    """Each device tier read back, or why it cannot be used."""
    out: dict[int, devring.Dump | str] = {}
    for index, p in files.items():
        try:
            out[index] = devring.read_dump(Path(p))
        except devring.DeviceTierError as exc:
            out[index] = str(exc)
    return out


_RECORD = struct.Struct("<IIQQQIIQQQ")  # the snapshot's call record (snapshot.cu, Record)
_SLOT_HEAD = struct.Struct("<IIQQQIIQQQ")  # a device ring slot's header (snapshot.cu, SlotHead)


def _device_rows(
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


def _earlier_host_copy(rec: SlotRecord) -> str | None:
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


def _from_twin(
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


def _write_report(
    path: Path,
    contents: JournalContents,
    bundles: list[Path],
    in_flight: list[SlotRecord],
    torn: list[SlotRecord],
    crash_context: dict[str, Any] | None,
    dumps: dict[int, devring.Dump | str] | None = None,
) -> None:
    def flight(rec: SlotRecord) -> dict[str, Any]:
        d = _slot_facts(rec)
        if rec.meta is not None:
            m = asdict(rec.meta)
            d.update({k: m[k] for k in ("args", "kwargs", "storages", "tensors", "extra")})
        return d

    doc = {
        "journal": str(contents.path),
        "pid": contents.header.pid,
        "host": contents.header.host,
        "created": contents.header.created,
        "process": contents.header.process,
        "crash": crash_context,
        "bundles": [str(p) for p in bundles],
        "in_flight": [flight(r) for r in in_flight],
        "torn": [{**_slot_facts(r), "reason": r.reason} for r in torn],
        "device_tiers": {
            str(i): (
                {"ring_bytes": d.layout.ring_bytes, "head": d.head}
                if isinstance(d, devring.Dump)
                else {"error": d}
            )
            for i, d in (dumps or {}).items()
        },
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def dead_journals(directory: str | os.PathLike[str]) -> list[Path]:
    """The journal files in `directory`, and in the run folders of `kdump record` there (left
    when kdump itself was killed), whose recording process is gone (others are skipped)."""
    found = []
    top = Path(directory)
    candidates = [*top.glob(f"{FILE_PREFIX}*"), *top.glob(f"{RUN_PREFIX}*/{FILE_PREFIX}*")]
    for p in sorted(candidates):
        try:
            pid = read_pid(p)
        except JournalError:
            continue
        if not pid_alive(pid):
            found.append(p)
    return found


def salvaged_graph_replays(paths: Sequence[str | os.PathLike[str]]) -> bool:
    """True when every path is a bundle file salvaged from a CUDA-graph replay (their replay
    reproduces the production sequence in graph mode)."""
    from kdump.bundle import load_bundle

    if not paths:
        return False
    for p in paths:
        if not Path(p).is_file():
            return False
        try:
            with load_bundle(p) as b:
                if "graph_replay" not in b.info:
                    return False
        except BundleError:
            return False
    return True
