"""The flight recorder's per-signature caches (CPU): a warm cache writes the same slots as a
recorder for which every call is its first (layouts, plans and the journal's JSON memo cleared
before each call), and every slot's JSON is byte for byte a one-encode reference of it."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.format.journal import SlotState
from kdump.record.config import RingConfig
from kdump.record.flight.journal_reader import read_journal
from kdump.record.flight.layout import SpanViews
from kdump.record.flight.recorder import RingRecorder
from kdump.record.flight.statics import first_views

T = __name__


def _reference_json(meta, spans) -> bytes:
    """The slot JSON in one encode, as the journal's memoised parts must reproduce it."""
    storages = [
        {**d, "payload": i if spans[i] is not None else None} for i, d in enumerate(meta.storages)
    ]
    doc = {
        "target": meta.target,
        "called_as": meta.called_as or meta.target,
        "names": meta.names,
        "args": meta.args,
        "kwargs": meta.kwargs,
        "storages": storages,
        "tensors": meta.tensors,
        "extra": meta.extra,
    }
    return json.dumps(doc, separators=(",", ":"), default=str).encode()


def gemm_like(a: torch.Tensor, w: torch.Tensor, layout: torch.Tensor, out: torch.Tensor, scale=1.0):
    out.copy_(a[: out.shape[0], : w.shape[1]] * scale + layout[: out.shape[0], None])


def _buffers() -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(7)
    return {
        "a": [torch.randn(16, 8, generator=g) for _ in range(2)],  # two addresses, alternating
        "w": torch.randn(128, 256, generator=g),  # over statics.MIN_BYTES: static once seen
        "layout": torch.zeros(16),
        "out": torch.empty(16, 8),
    }


def _calls(bufs: dict[str, Any], capturing: list[bool]) -> None:
    """The same sequence for both recorders. Inputs change through `.data` (their version
    counters stay); the output and, once, the weight change in place, so their versions move
    by the same steps in both runs (compared relative to each run's first)."""
    g = torch.Generator(device="cpu").manual_seed(11)
    scales = [1.0, 0.5, 0.5, 2.0, 1.0, 1.0, 3.0, 0.5, 1.0, 0.5, 1.0, 1.0]
    bufs["out"].data.zero_()
    for i, s in enumerate(scales):
        a = bufs["a"][i % 2]
        a.data.copy_(torch.randn(16, 8, generator=g))
        bufs["layout"].data.copy_(torch.randint(-1, 4, (16,), generator=g).float())  # routing
        capturing[0] = i == 5  # one capture site: a pinned slot
        if i == 4:
            bufs["w"].mul_(1.0)  # a new version of the static: copied again
        gemm_like(a, bufs["w"], bufs["layout"], bufs["out"], scale=s)
    capturing[0] = False


def _raw_docs(path: Path) -> dict[int, bytes]:
    """Per slot index: the slot JSON exactly as written."""
    raw = path.read_bytes()
    got = read_journal(path)
    out = {}
    for rec in got.having(SlotState.COMPLETE):
        base = got.header.header_bytes + rec.index * got.header.slot_bytes
        (k,) = struct.unpack_from("<I", raw, base + 28)
        (jlen,) = struct.unpack_from("<I", raw, base + 64)
        start = base + 72 + 16 * k
        out[rec.index] = raw[start : start + jlen]
    return out


def _record(
    tmp_path: Path, name: str, monkeypatch, cold: bool, bufs: dict[str, Any]
) -> tuple[dict, list[Path]]:
    capturing = [False]
    monkeypatch.setattr(RingRecorder, "_is_capturing", staticmethod(lambda cuda: capturing[0]))
    before = RingRecorder._before
    if cold:

        def first_call_every_time(self: RingRecorder, *a: Any, **k: Any) -> Any:
            self._layouts.clear()
            self._plans.clear()
            if self.journal is not None:
                self.journal._parts.clear()
            return before(self, *a, **k)

        monkeypatch.setattr(RingRecorder, "_before", first_call_every_time)
    ring = RingConfig(slots=16, slot_bytes=256 << 10, journal_dir=tmp_path / name / "shm")
    with kdump.recording(
        f"{T}:gemm_like", out=tmp_path / name / "out", mode="ring", ring=ring
    ) as rec:
        _calls(bufs, capturing)
        r = rec.recorder
        assert r.errors == 0
        if not cold:
            assert len(r._layouts) < 12  # the cache was used: fewer layouts than calls
        path = r.journal.path
        docs = _raw_docs(path)
        slots = {}
        complete = read_journal(path).having(SlotState.COMPLETE)
        first: dict[int, int] = {}  # per storage address: its lowest version in this run
        for s in complete:
            for d in s.meta.storages:
                if "version" in d:
                    first[d["base_ptr"]] = min(first.get(d["base_ptr"], 1 << 62), d["version"])
        for s in complete:
            assert docs[s.index] == _reference_json(s.meta, list(s.spans))
            extra = {k: v for k, v in s.meta.extra.items() if k != "time_ns"}
            storages = []
            for d in s.meta.storages:
                d = dict(d)
                if "version" in d:
                    d["version"] -= first[d["base_ptr"]]
                if "version" in d.get("static", {}):
                    d["static"] = dict(d["static"])
                    d["static"]["version"] -= first[d["base_ptr"]]
                storages.append(d)
            meta = replace(s.meta, extra=extra, storages=storages)
            slots[s.meta.call_index] = (s.index, meta, s.payloads, s.finished)
        rec.flush()
        written = list(rec.written)
    monkeypatch.setattr(RingRecorder, "_before", before)
    return slots, written


def _bundle_facts(paths: list[Path]) -> dict[int, Any]:
    out = {}
    for p in paths:
        with load_bundle(p) as b:
            for c in b.calls:
                meta = {k: v for k, v in c.meta.items() if k not in ("time_ns", "recorded_at")}
                journal = {k: v for k, v in meta.get("journal", {}).items() if k != "path"}
                meta["journal"] = journal
                args = [a.clone() if isinstance(a, torch.Tensor) else a for a in c.args]
                out.setdefault(c.meta["call_index"], []).append(
                    (len(b.calls), meta, args, dict(c.kwargs))
                )
    return out


def test_warm_cache_writes_what_first_calls_write(tmp_path, monkeypatch):
    bufs = _buffers()  # one set for both runs: the same addresses
    warm, warm_b = _record(tmp_path, "warm", monkeypatch, False, bufs)
    cold, cold_b = _record(tmp_path, "cold", monkeypatch, True, bufs)
    assert sorted(warm) == sorted(cold) == list(range(12))
    for i in warm:
        assert warm[i] == cold[i], f"call {i}"
    wf, cf = _bundle_facts(warm_b), _bundle_facts(cold_b)
    assert sorted(wf) == sorted(cf)
    for i in wf:
        assert len(wf[i]) == len(cf[i])
        for (n1, m1, a1, k1), (n2, m2, a2, k2) in zip(wf[i], cf[i]):
            assert n1 == n2 and m1 == m2 and k1 == k2, f"call {i}"
            for x, y in zip(a1, a2):
                if isinstance(x, torch.Tensor):
                    assert torch.equal(x, y), f"call {i}"
                else:
                    assert x == y


def test_span_views_match_byte_views():
    from kdump.bundle.tensors import _byte_view, group_storages

    base = torch.arange(64, dtype=torch.float32)
    tensors = [base[8:24].view(4, 4), torch.arange(5, dtype=torch.int32), base[30:40]]
    storages, records = group_storages(tensors)
    views = SpanViews(tensors, first_views(records, len(storages)), storages)
    assert len(views) == len(storages) == 2
    for i, s in enumerate(storages):
        ref = _byte_view(
            tensors[[r.storage for r in records].index(i)], s.span_start, s.span_nbytes
        )
        assert views.nbytes(i) == ref.numel()
        assert views.ptr(i) == ref.data_ptr() == views[i].data_ptr()
        assert torch.equal(views[i], ref)
    assert views[0] is views[0]  # made once


@pytest.mark.gpu
def test_current_stream_handle_matches_torch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kdump.record.flight.devcopy import current_stream

    dev = torch.cuda.current_device()
    assert current_stream(dev) == int(torch.cuda.current_stream().cuda_stream)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(dev) == int(side.cuda_stream)
