"""The device tier on a GPU: the fused snapshot kernel bitwise against the reference semantics
(eager, with and without a salvage process holding the tier; inside a captured graph across
replays with changed routing and device-side slot rotation), the torch fallback, and the
recorder end to end on the packaged GEMM."""

from __future__ import annotations

import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch

from kdump.bundle import load_bundle
from kdump.bundle.tensors import group_storages
from kdump.format import argtree
from kdump.format.journal import CALL_RECORD_BYTES, TRAILER_BYTES, SlotMeta, SlotState
from kdump.format.records import storage_layout_json, tensor_json
from kdump.record.flight import devring, gather
from kdump.record.flight.journal import Journal
from kdump.record.flight.journal_reader import read_journal
from kdump.record.flight.layout import span_views
from kdump.record.flight.salvage import salvage_journal

pytestmark = pytest.mark.gpu
CONTIG = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
_RECORD = struct.Struct("<IIQQQIIQQQ")


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _operands(sizes: list[int], k: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    labels = []
    for e, n in enumerate(sizes):
        labels += [e] * n + [-1] * (128 - n)
    labels_t = torch.tensor(labels, dtype=torch.int32)
    m = labels_t.numel()
    a = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    sfa = torch.empty_strided((m, k // 128), (1, -(-m // 4) * 4), dtype=torch.float32)
    sfa.copy_(torch.randn(m, k // 128, generator=g))
    return a.cuda(), sfa.cuda(), labels_t.cuda()


@pytest.fixture
def shm():
    """A folder in shared memory for the journal: cudaHostRegister refuses the page-cache pages
    of a file on a disk filesystem (the recorder's journals live in /dev/shm too)."""
    d = Path(tempfile.mkdtemp(prefix="kdump-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _devcopies(shm: Path, budget: int = 64 << 20):
    from kdump.record.flight.devcopy import DeviceCopies

    j = Journal.create(shm, slots=8, slot_bytes=256 << 10)
    return j, DeviceCopies(j, torch.device("cuda", torch.cuda.current_device()), budget)


def _reserve(j, dc, a, sfa, labels, index=None, use_plan=True):
    tensors = [a, sfa, labels]
    storages, records = group_storages(tensors)
    plan = gather.make_plan(tensors, records, storages, [0, 1], "labels", 2, 1)
    if not use_plan:
        plan = None
    seen: list = []
    dev = dc.facts()
    if plan is not None:
        dev["plan"] = plan.to_json()
    meta = SlotMeta(
        call_index=0,
        target=CONTIG,
        called_as=CONTIG,
        args=[argtree.encode(v, seen) for v in ((a, sfa), labels)],
        storages=[storage_layout_json(s) for s in storages],
        tensors=[tensor_json(r, nbytes=True) for r in records],
        extra={"device": dev},
        capture_id=1 if index is not None else 0,  # a pinned slot is a capture site's, as recorded
    )
    whole = None
    if plan is not None and dc.kernel is None:
        whole = dc.whole_layout(plan, storages)
        dev["whole"] = whole
    gathered = plan.storages if plan is not None else frozenset()
    want = [i not in gathered for i in range(len(storages))]
    slot = j.reserve(meta, index=index, want=want)
    return slot, span_views(tensors, records, storages), plan, whole


def _salvaged(j, dc, tmp_path: Path, name: str):
    torch.cuda.synchronize()
    dump = dc.tier.dump(tmp_path / f"{name}.cuda0")
    res = salvage_journal(j.path, tmp_path / name, remove=False, device_dumps={0: dump})
    return res


def _check_rows(bundle: Path, a, sfa, labels) -> dict:
    keep = (labels >= 0).cpu()
    with load_bundle(bundle) as b:
        call = b.calls[-1]
        (a2, s2) = call.args[0]
        # the routing labels: the int32 argument (args[1] here, args[3] in DeepGEMM's order)
        lab = next(x for x in call.args if isinstance(x, torch.Tensor) and x.dtype == torch.int32)
        assert torch.equal(lab, labels.cpu())
        assert torch.equal(a2.view(torch.uint8)[keep], a.view(torch.uint8).cpu()[keep])
        assert not a2.view(torch.uint8)[~keep].any()
        assert torch.equal(s2[keep], sfa.cpu()[keep])
        return call.meta["journal"]


@pytest.mark.parametrize("held", [False, True])
def test_eager_snapshot_is_bitwise_the_reference(tmp_path, shm, held):
    j, dc = _devcopies(shm)
    assert dc.kernel is not None, dc.notes
    dc.tier.held = held  # held: host copy on the side stream
    a, sfa, labels = _operands([3, 0, 128, 17])
    slot, views, plan, _ = _reserve(j, dc, a, sfa, labels)
    after = dc.copy(slot, views, None, plan, labels, 0, False)
    after()
    res = _salvaged(j, dc, tmp_path, "eager")
    (bundle,) = res.bundles
    facts = _check_rows(bundle, a, sfa, labels)
    assert facts["device"]["rows_kept"] == 148 and facts["finished"]
    if held:
        # an eager call's host copy waits for its batch: salvage above took the slot from the
        # twin; the host slot is complete once the batch is issued
        assert not read_journal(j.path).having(SlotState.COMPLETE)
        dc.drain(wait=True)
    # the device records against the reference semantics, bit for bit
    dump = devring.read_dump(tmp_path / "eager.cuda0")
    rec = read_journal(j.path).having(SlotState.COMPLETE)[0].call_record
    _, rows, _, _, pos, *_ = _RECORD.unpack(rec)
    data = dump.ring(pos + gather.SLOT_HEAD, rows * plan.rec_bytes)
    got = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(rows, plan.rec_bytes)
    spans = [v.cpu() for v in views]
    _, want = gather.reference_gather(plan, spans, labels.cpu())
    assert torch.equal(gather.sort_records(got), want)


def test_graph_replays_rotate_device_slots_and_keep_each_replays_rows(tmp_path, shm):
    j, dc = _devcopies(shm)
    dc.tier.held = True
    a, sfa, labels = _operands([5, 9, 0, 64])
    d = torch.zeros(a.shape[0], 8, device="cuda")
    index = j.pin_next()
    slot, views, plan, _ = _reserve(j, dc, a, sfa, labels, index=index)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        after = dc.copy(slot, views, 0, plan, labels, 0, True)
        d.add_(labels.view(-1, 1).float())  # the "kernel"
        after()
        dc.join_capture()
        graph.capture_end()
    positions = []
    for replay, sizes in enumerate(([1, 2, 3, 4], [128, 0, 0, 7], [0, 0, 0, 0], [9, 9, 9, 9]), 1):
        na, ns, nl = _operands(sizes, seed=replay)
        a.copy_(na)
        sfa.copy_(ns)
        labels.copy_(nl)
        graph.replay()
        res = _salvaged(j, dc, tmp_path, f"r{replay}")
        seen = [
            (r.index, r.state.name, r.reason, r.markers)
            for r in read_journal(j.path).slots
            if r.state is not SlotState.EMPTY
        ]
        # what the device side holds: the twin's call record, the site counter, the ring head
        dump = devring.read_dump(tmp_path / f"r{replay}.cuda0")
        at = j.slot_bytes - TRAILER_BYTES - CALL_RECORD_BYTES  # the record, before the trailer
        twin = _RECORD.unpack(dump.twin_slot(index)[at : at + CALL_RECORD_BYTES])
        device = f"twin record {twin}, counter {int(dc.counters[0])}, head {dump.head}"
        assert len(res.bundles) == 1, f"replay {replay}: {seen}; {device}; torn {res.torn}"
        (bundle,) = res.bundles
        _check_rows(bundle, a, sfa, labels)
        (s,) = read_journal(j.path).having(SlotState.COMPLETE)
        # one site: its done marker is the previous replay's, written by this replay's snapshot
        assert s.token == replay and s.markers[2] == replay - 1 and not s.finished
        _, rows, _, token, pos, *_ = _RECORD.unpack(s.call_record)
        assert token == replay and rows == sum(sizes)
        positions.append(pos)
    assert len(set(positions)) == 4  # each replay its own device slot, picked on the device


def test_graph_sites_mark_each_other_done_with_one_node_each(tmp_path, shm):
    """Two sites in one capture: the second's snapshot writes the first's done marker, the
    first's at the next replay the second's; the graph holds one kernel node per site plus the
    recorded kernels (no done-marker node)."""
    j, dc = _devcopies(shm)
    dc.tier.held = False  # no side branch: the captured graph is the main stream's nodes only
    a, sfa, labels = _operands([5, 9, 0, 64])
    b, sfb, labels_b = _operands([1, 2, 3, 4], seed=9)
    d = torch.zeros(a.shape[0], 8, device="cuda")
    ia, ib = j.pin_next(), j.pin_next()
    slot_a, views_a, plan_a, _ = _reserve(j, dc, a, sfa, labels, index=ia)
    slot_b, views_b, plan_b, _ = _reserve(j, dc, b, sfb, labels_b, index=ib)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        dc.copy(slot_a, views_a, 0, plan_a, labels, 0, True, None, 7)()
        d.add_(labels.view(-1, 1).float())  # the first "kernel"
        dc.copy(slot_b, views_b, 1, plan_b, labels_b, 1, True, None, 7)()
        d.add_(labels_b.view(-1, 1).float())  # the second
        graph.capture_end()
    for replay in (1, 2, 3):
        graph.replay()
        torch.cuda.synchronize()
        by_index = {r.index: r for r in read_journal(j.path).having(SlotState.COMPLETE)}
        ra, rb = by_index[ia], by_index[ib]
        assert ra.markers == (replay, replay, replay) and ra.finished, ra.markers
        assert rb.markers == (replay, replay, replay - 1) and not rb.finished, rb.markers
    assert int(dc.counters[0]) == int(dc.counters[1]) == 3


def test_overwritten_device_slot_is_marked_missing(tmp_path, shm):
    twin = 8 * (256 << 10)
    j, dc = _devcopies(shm, budget=devring.TWIN_AT + twin + (8 << 20))
    assert dc.tier.layout.ring_bytes == 8 << 20
    a, sfa, labels = _operands([128] * 16)  # ~1.1 MiB of rows per call in an ~8 MiB ring
    for i in range(12):
        slot, views, plan, _ = _reserve(j, dc, a, sfa, labels)
        dc.copy(slot, views, None, plan, labels, i, False)()
    res = _salvaged(j, dc, tmp_path, "wrap")
    by_seq = {}
    for p in res.bundles:
        with load_bundle(p) as b:
            by_seq[b.calls[0].meta["journal"]["seq"]] = b.calls[0].meta["journal"]
    # slots of 1,114,368 bytes: 7 fit a lap; after 12 calls the 5th (seq 5) was overwritten by
    # the 12th, the 6th..12th still hold their rows
    assert sorted(by_seq) == list(range(5, 13))
    assert "overwritten" in by_seq[5]["device"]["missing"]
    assert all("rows_kept" in by_seq[s]["device"] for s in range(6, 13))


def test_torch_fallback_fills_the_twin_and_copies_bulky_storages_whole(tmp_path, shm):
    j, dc = _devcopies(shm)
    dc.kernel = None  # as without NVRTC
    assert "torch" in dc.facts()["snapshot"]
    a, sfa, labels = _operands([2, 0, 7])
    for held in (False, True):
        dc.tier.held = held
        slot, views, plan, whole = _reserve(j, dc, a, sfa, labels)
        assert whole is not None
        dc.copy(slot, views, None, plan, labels, 0, False, whole)()
    res = _salvaged(j, dc, tmp_path, "fallback")
    assert len(res.bundles) == 2
    for p in res.bundles:
        with load_bundle(p) as b:
            call = b.calls[0]
            assert "whole" in call.meta["journal"]["device"]["copied"]
            (a2, s2), lab = call.args[0], call.args[1]
            assert torch.equal(a2.view(torch.uint8), a.view(torch.uint8).cpu())  # every row
            assert torch.equal(s2, sfa.cpu()) and torch.equal(lab, labels.cpu())


def test_torch_fallback_inside_a_graph_keeps_each_replay(tmp_path, shm):
    j, dc = _devcopies(shm)
    dc.kernel = None
    dc.tier.held = True
    a, sfa, labels = _operands([3, 3])
    slot, views, plan, whole = _reserve(j, dc, a, sfa, labels, index=j.pin_next())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        after = dc.copy(slot, views, 0, plan, labels, 0, True, whole)
        after()
        dc.join_capture()
    for replay in (1, 2, 3):
        na, ns, nl = _operands([replay, 5 - replay], seed=replay)
        a.copy_(na)
        sfa.copy_(ns)
        labels.copy_(nl)
        graph.replay()
        (bundle,) = _salvaged(j, dc, tmp_path, f"g{replay}").bundles
        with load_bundle(bundle) as b:
            call = b.calls[-1]
            assert call.meta["journal"]["replay"] == replay
            assert torch.equal(call.args[0][0].view(torch.uint8), a.view(torch.uint8).cpu())


def test_recorder_end_to_end_on_the_packaged_gemm(tmp_path, shm):
    import kdump
    from kdump.kernels import registry
    from kdump.kernels.sm120 import api
    from kdump.record.config import RingConfig

    spec = registry.spec_for(CONTIG)
    args, kwargs = spec.generate(
        seed=1, device="cuda", scale_format="fp32", num_groups=8, n=256, k=512, expected_m=20
    )
    ring = RingConfig(slots=8, slot_bytes=1 << 20, journal_dir=shm)
    target = "kdump.kernels.sm120.api:m_grouped_fp8_gemm_nt_contiguous"
    with kdump.recording(target, out=tmp_path / "out", mode="ring", ring=ring) as rec:
        for _ in range(3):
            api.m_grouped_fp8_gemm_nt_contiguous(*args, **kwargs)
        torch.cuda.synchronize()
        rec.flush()
        written = list(rec.written)
    assert len(written) == 3
    a, sfa = args[0]
    labels = args[3]
    facts = _check_rows(written[0], a, sfa, labels)
    assert facts["device"]["rows_kept"] > 0


def _renewed(args: tuple) -> tuple:
    """DeepGEMM's arguments with A, its scales, D and the labels new tensor objects over the same
    memory (a serving step's activations in the caching allocator's blocks of the step before);
    B and its scales the same objects."""

    def new(t):
        return t.as_strided(t.shape, t.stride(), t.storage_offset())

    (a, sfa), b, d, labels = args
    return ((new(a), new(sfa)), b, new(d), new(labels))


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("held", [False, True])
def test_eager_repeats_around_the_ring_use_the_enqueue_memo_and_stay_bitwise(
    tmp_path, shm, monkeypatch, held, fresh
):
    """Eager repeats of one call, three times around a 4-slot journal: from the second round on
    each slot's enqueue comes from the memo (`DeviceCopies.copy`); the flushed bundles are the
    last four calls, each complete, finished and bitwise the operands' kept rows. `fresh`: every
    call passes new tensor objects over the same memory (but for the weights), as a serving loop
    does: the repeat path takes them too."""
    import kdump
    from kdump.kernels import registry
    from kdump.kernels.sm120 import api
    from kdump.record.config import RingConfig
    from kdump.record.flight import devcopy

    taken = []
    again = devcopy.DeviceCopies._copy_again

    def spy(self, e, slot, *a):
        taken.append(slot.index)
        return again(self, e, slot, *a)

    monkeypatch.setattr(devcopy.DeviceCopies, "_copy_again", spy)
    spec = registry.spec_for(CONTIG)
    args, kwargs = spec.generate(
        seed=3, device="cuda", scale_format="fp32", num_groups=8, n=256, k=512, expected_m=20
    )
    ring = RingConfig(slots=4, slot_bytes=1 << 20, journal_dir=shm)
    target = "kdump.kernels.sm120.api:m_grouped_fp8_gemm_nt_contiguous"
    with kdump.recording(target, out=tmp_path / "out", mode="ring", ring=ring) as rec:
        api.m_grouped_fp8_gemm_nt_contiguous(*args, **kwargs)  # the device side starts here
        cuda = rec.recorder._cuda
        assert cuda is not None and cuda.tier is not None and cuda._cu is not None
        cuda.tier.held = held
        for _ in range(13):
            api.m_grouped_fp8_gemm_nt_contiguous(*(_renewed(args) if fresh else args), **kwargs)
        torch.cuda.synchronize()
        assert rec.recorder.errors == 0 and rec.recorder.fast_calls >= 8
        rec.flush()
        written = list(rec.written)
    assert len(taken) >= 4 and set(taken) <= {0, 1, 2, 3}
    assert len(written) == 4
    a, sfa = args[0]
    labels = args[3]
    seen = []
    for bundle in written:
        facts = _check_rows(bundle, a, sfa, labels)
        assert facts["finished"] and facts["device"]["rows_kept"] > 0
        seen.append(facts["call_index"])
    assert len(set(seen)) == 4 and min(seen) >= 10  # the last four calls


def test_graphs_captured_while_recording_replay_after_the_recording_ends(tmp_path, shm):
    """A graph captured inside `kdump.recording` writes into the journal, its device twin and
    ring at every replay: leaving the recording keeps that memory (the files go), so replays
    after it run clean and the output stays right."""
    import kdump
    from kdump.kernels import registry
    from kdump.kernels.sm120 import api
    from kdump.record.config import RingConfig
    from kdump.record.flight import recorder as ring_mod

    spec = registry.spec_for(CONTIG)
    args, kwargs = spec.generate(
        seed=2, device="cuda", scale_format="fp32", num_groups=8, n=256, k=512, expected_m=20
    )
    ring = RingConfig(slots=8, slot_bytes=1 << 20, journal_dir=shm)
    target = "kdump.kernels.sm120.api:m_grouped_fp8_gemm_nt_contiguous"
    kept = len(ring_mod._RETIRED)
    with kdump.recording(target, out=tmp_path / "out", mode="ring", ring=ring):
        api.m_grouped_fp8_gemm_nt_contiguous(*args, **kwargs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            api.m_grouped_fp8_gemm_nt_contiguous(*args, **kwargs)
        graph.replay()
        torch.cuda.synchronize()
    assert len(ring_mod._RETIRED) == kept + 1
    assert not list(shm.glob("kdump-journal-*"))  # the files are gone, the mappings stay
    d = args[2]
    want = d.clone()
    for _ in range(20):
        d.zero_()
        graph.replay()
    torch.cuda.synchronize()  # an unmapped journal or freed ring would fault here
    valid = args[3] >= 0  # padding rows are the kernel's to leave alone
    assert torch.equal(d[valid], want[valid])
