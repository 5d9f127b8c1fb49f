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

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kdump.errors import BundleError
from kdump.format.journal import (
    FILE_PREFIX,
    RUN_PREFIX,
    JournalContents,
    JournalError,
    SlotRecord,
    SlotState,
    launch_record,
)
from kdump.format.records import (
    Source,
    StorageRecord,
    storage_from_json,
    storage_layout_json,
    tensor_from_json,
)
from kdump.progress import Bar
from kdump.record.flight import devring
from kdump.record.flight.announce import dump_paths, pid_alive
from kdump.record.flight.journal_reader import read_journal, read_pid
from kdump.record.flight.salvage_device import (
    Sparse,
    device_rows,
    earlier_host_copy,
    from_twin,
    read_dumps,
)
from kdump.record.flight.statics import region_path
from kdump.record.flight.statics_reader import Region, read_region, salvaged_storage

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
    dumps = read_dumps(dump_files)
    crash_context = _with_last_words(contents.path, crash_context)
    raised = read_raised(contents.path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = contents.header
    torn = contents.having(SlotState.TORN)
    bundles: list[Path] = []
    complete, kept_in_flight = _completed_from_twins(contents, dumps)
    by_seq = {r.seq: r for r in complete}
    died_at = _died_at(complete, kept_in_flight, crash_context)
    names = sorted(_bundle_name(head.pid, r) for r in complete if r.seq in died_at)
    region = read_region(contents.path)  # static operands copied once (kdump.record.flight.statics)
    if progress is not None:
        progress.total = (progress.total or 0) + len(complete)
    # A later copy into the static region can fill a weight an older bundle held by reference.
    statics = tuple((e.index, e.seq, e.copied) for e in region.entries) if region else ()
    for rec in complete:
        if progress is not None and rec is not complete[0]:
            progress.advance()  # the call before this one is written
        stale = earlier_host_copy(rec)
        if stale is not None:
            torn.append(SlotRecord(rec.index, SlotState.TORN, rec.seq, rec.meta, (), stale))
            continue
        path = out / _bundle_name(head.pid, rec)
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
        _remove_journal(contents.path, dump_files)
    return SalvageResult(contents.path, bundles, in_flight, torn, report)


def _bundle_name(pid: int, rec: SlotRecord) -> str:
    assert rec.meta is not None  # complete slots always carry their metadata
    return f"journal-{pid}-call-{rec.meta.call_index:06d}-seq{rec.seq}.kdump"


def _with_last_words(journal: Path, crash_context: dict[str, Any] | None) -> dict[str, Any] | None:
    """The crash context with what the recorded process wrote when an exception ended it."""
    try:
        said = json.loads(_last_words_path(journal).read_text())
        if isinstance(said, dict):
            return {**(crash_context or {}), **said}
    except (OSError, ValueError):
        pass
    return crash_context


def _last_words_path(journal: Path) -> Path:
    return journal.with_name(journal.name + CRASH_SUFFIX)


def _completed_from_twins(
    contents: JournalContents, dumps: dict[int, devring.Dump | str]
) -> tuple[list[SlotRecord], list[SlotRecord]]:
    """(complete slots, newest first, slots still in flight): a slot in flight whose device
    twin holds its finished snapshot counts as complete."""
    complete = contents.having(SlotState.COMPLETE)
    kept_in_flight = []
    for rec in contents.having(SlotState.IN_FLIGHT):
        try:
            recovered = from_twin(rec, dumps, contents.header.slot_bytes)
        except Exception:  # metadata it cannot use: the slot stays in flight
            recovered = None
        if recovered is not None:
            complete.append(recovered)
        else:
            kept_in_flight.append(rec)
    complete.sort(key=lambda r: -r.seq)
    return complete, kept_in_flight


def _remove_journal(journal: Path, dump_files: dict[int, Path]) -> None:
    """The journal and the files next to it, once salvaged."""
    journal.unlink(missing_ok=True)
    _last_words_path(journal).unlink(missing_ok=True)
    raised_path(journal).unlink(missing_ok=True)
    region_path(journal).unlink(missing_ok=True)
    for p in dump_files.values():
        Path(p).unlink(missing_ok=True)


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
    from kdump.bundle import CallRecord, Captured

    meta = rec.meta
    assert meta is not None  # complete slots always carry their metadata
    rows, device_facts = device_rows(rec, dumps or {})
    payloads = [rows[i] if p is None and i in rows else p for i, p in enumerate(rec.payloads)]
    storages, data, statics, digests = _storages(meta.storages, payloads, region)
    tensors, missing, by_ref = [], [], []
    for i, t in enumerate(meta.tensors):
        tensors.append(tensor_from_json(t))
        source = storages[tensors[-1].storage].source
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
        launch=launch_record(meta.launch),
    )
    if meta.outputs:
        _attach_outputs(call, rec)
    return call


def _storages(
    slot_storages: list[dict[str, Any]],
    payloads: list[bytes | Sparse | None],
    region: Region | None,
) -> tuple[list[StorageRecord], list[Any], list[dict[str, Any]], list[Any]]:
    """The call's storage records, their bytes (uint8 tensors, empty where not held), what the
    static region said of each static one, and the digests already known."""
    import torch

    storages, data, statics, digests = [], [], [], []
    for j, (s, payload) in enumerate(zip(slot_storages, payloads)):
        ranges: tuple[tuple[int, int], ...] = ()
        sparse = isinstance(payload, Sparse)
        if isinstance(payload, Sparse):
            payload, ranges = payload.data, payload.ranges
        got = salvaged_storage(s, payload, region)
        digests.append(got.digests)
        source = Source.SPARSE if sparse else got.source
        storages.append(
            replace(storage_from_json(s), source=source, stats=got.stats, ranges=ranges)
        )
        data.append(got.data if got.data is not None else torch.empty(0, dtype=torch.uint8))
        if got.static:
            statics.append({"storage": j, "source": got.source.value, "why": got.note})
    return storages, data, statics, digests


def _attach_outputs(call: Any, rec: SlotRecord) -> None:
    """The slot's post-call payloads as the call's outputs (`kdump.bundle.writer.
    attach_outputs`'s form), and what the bundle says about those it lacks."""
    import torch

    from kdump.bundle import Captured

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
        storages.append(storage_from_json(storage_layout_json(s)))  # the layout only
        data.append(post)
        for i in changed:
            inplace.append((i, len(kept_tensors)))
            kept_tensors.append(replace(call.inputs.tensors[i], storage=k))
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
    from kdump.format import argtree

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
