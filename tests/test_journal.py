"""The flight recorder's host-tier journal: format round trip, torn-slot detection (truncation,
byte flips, SIGKILL at random moments), ring wrap, shrinking to the free space, salvage to
bundles and `kdump salvage`."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from kdump.bundle import capture_call, load_bundle
from kdump.cli import cli
from kdump.format.journal import JournalError, SlotMeta, SlotState
from kdump.format.records import Source
from kdump.record.flight import journal as jmod
from kdump.record.flight.journal import Journal, meta_from_call
from kdump.record.flight.journal_reader import read_journal
from kdump.record.flight.salvage import salvage, salvage_journal

TARGET = "tests.fake_kernels:grouped_gemm"


def make_call(seed: int, big: int = 0) -> tuple[list[torch.Tensor], object]:
    """A call with real random data: an fp32 matrix, a strided view into it, int32 indices, and
    (with `big`) a large bf16 tensor."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(16, 24, generator=g, device="cpu")
    view = a[2:, 3:7]  # shares a's storage: one payload, two layouts
    idx = torch.randint(-1000, 1000, (37,), generator=g, device="cpu", dtype=torch.int32)
    args: list[object] = [a, view, idx, 3, 0.5]
    live = [a, view, idx]
    if big:
        t = torch.randn(big, generator=g, device="cpu").to(torch.bfloat16)
        args.append(t)
        live.append(t)
    call = capture_call(TARGET, args, {"mode": "nt"}, names=["a", "v", "idx", "k", "s", "b"])
    return live, call


def payloads_of(call: object) -> list[bytes]:
    return [d.numpy().tobytes() for d in call.inputs.data]  # type: ignore[attr-defined]


def record(j: Journal, seed: int, **fields: object) -> tuple[list[torch.Tensor], list[bytes]]:
    live, call = make_call(seed)
    meta = meta_from_call(call, call_index=seed, **fields)
    data = payloads_of(call)
    j.record(meta, data)
    return live, data


def test_round_trip_random_data(tmp_path: Path) -> None:
    proc = {"argv": ["python", "serve.py", "--tp", "8"], "env": {"CUDA_VISIBLE_DEVICES": "3"}}
    j = Journal.create(tmp_path, slots=8, slot_bytes=64 << 10, process_info=proc)
    assert j.path.parent == tmp_path and j.path.name.startswith("kdump-journal-")
    written = {}
    for i in range(5):
        _, data = record(
            j, i, target_id=7, stream=0x7F00 + i, capture_id=i, graph_id=2 * i, replay=i * 3
        )
        written[i] = data
    j.close()
    got = read_journal(j.path)
    assert got.header.pid == os.getpid() and got.header.process == proc
    assert got.header.slot_count == 8 and got.header.slot_bytes == 64 << 10
    complete = got.having(SlotState.COMPLETE)
    assert [s.meta.call_index for s in complete] == [4, 3, 2, 1, 0]
    assert [s.seq for s in complete] == [5, 4, 3, 2, 1]
    assert len(got.having(SlotState.EMPTY)) == 3
    for s in complete:
        i = s.meta.call_index
        assert list(s.payloads) == written[i]
        assert s.meta.target == TARGET and s.meta.target_id == 7
        assert (s.meta.stream, s.meta.capture_id, s.meta.graph_id, s.meta.replay) == (
            0x7F00 + i,
            i,
            2 * i,
            3 * i,
        )
        _, call = make_call(i)
        assert s.meta.args == call.args and s.meta.kwargs == {"mode": "nt"}
        shapes = [t["shape"] for t in s.meta.tensors]
        assert shapes == [[16, 24], [14, 4], [37]]
        assert [t["nbytes"] for t in s.meta.tensors] == [16 * 24 * 4, 14 * 4 * 4, 37 * 4]


def test_ring_wraps_and_keeps_the_newest(tmp_path: Path) -> None:
    j = Journal.create(tmp_path / "ring", slots=4, slot_bytes=16 << 10)
    data = {i: record(j, i)[1] for i in range(11)}
    got = read_journal(j.path)
    j.unlink()
    assert not (tmp_path / "ring").exists()
    complete = got.having(SlotState.COMPLETE)
    assert [s.meta.call_index for s in complete] == [10, 9, 8, 7]
    for s in complete:
        assert list(s.payloads) == data[s.meta.call_index]


def test_stale_slot_cannot_commit_after_the_ring_reused_it(tmp_path: Path) -> None:
    j = Journal.create(tmp_path / "j", slots=2, slot_bytes=16 << 10)
    _, call = make_call(1)
    old = j.reserve(meta_from_call(call, 1))
    record(j, 2)
    record(j, 3)  # takes old's slot
    with pytest.raises(JournalError, match="reused"):
        old.commit()
    j.close()


def test_in_flight_slot_is_reported_never_salvaged(tmp_path: Path) -> None:
    j = Journal.create(tmp_path / "j", slots=4, slot_bytes=16 << 10)
    record(j, 1)
    _, call = make_call(2)
    slot = j.reserve(meta_from_call(call, 2, after_kernel=True))
    slot.payload(0)[:100] = bytes(range(100))  # a partial copy: must never reach a bundle
    got = read_journal(j.path)
    flight = got.having(SlotState.IN_FLIGHT)
    assert [(s.meta.call_index, s.meta.after_kernel, s.payloads) for s in flight] == [(2, True, ())]
    res = salvage_journal(j.path, tmp_path / "out", {"signal": 6})
    assert [load_bundle(p).calls[0].meta["journal"]["call_index"] for p in res.bundles] == [1]
    report = json.loads(res.report.read_text())
    assert [f["call_index"] for f in report["in_flight"]] == [2]
    assert report["in_flight"][0]["tensors"][2]["shape"] == [37]
    assert report["crash"] == {"signal": 6}
    j.close()


class _CrashAfter:
    """Stands in for the journal's mapped view: lets `n` writes through, then 'dies'."""

    def __init__(self, view: memoryview, n: int) -> None:
        self.view, self.left = view, n

    def __getitem__(self, key: slice) -> memoryview:
        return self.view[key]

    def __setitem__(self, key: slice, value: bytes) -> None:
        if self.left == 0:
            raise KeyboardInterrupt  # the process is gone: nothing after this lands
        self.left -= 1
        self.view[key] = value


def test_refill_cut_at_every_write_never_mixes_calls(tmp_path: Path) -> None:
    _, new_call = make_call(9)
    new_data = payloads_of(new_call)
    writes_in_reserve = 4  # refill marker, header magic, table + JSON, fixed part
    for n in range(writes_in_reserve + len(new_data) + 1):
        j = Journal.create(tmp_path / f"j{n}", slots=2, slot_bytes=16 << 10)
        old = {i: record(j, i)[1] for i in range(2)}  # slot 0 holds call 0
        real = j._view
        j._view = _CrashAfter(real, n)  # type: ignore[assignment]
        try:
            slot = j.reserve(meta_from_call(new_call, 9))
            j._view = real
            for i in range(n - writes_in_reserve):
                slot.payload(i)[:] = new_data[i]
        except KeyboardInterrupt:
            pass
        j._view = real
        got = {s.index: s for s in read_journal(j.path).slots}
        s0 = got[0]
        if n == 0:  # nothing was written yet: the old call is intact
            assert s0.state is SlotState.COMPLETE and list(s0.payloads) == old[0]
        elif n < writes_in_reserve:
            assert s0.state is SlotState.TORN, n
        else:
            assert s0.state is SlotState.IN_FLIGHT and s0.meta.call_index == 9, n
        assert got[1].state is SlotState.COMPLETE and list(got[1].payloads) == old[1]
        j.close()


def test_oversized_call_keeps_layouts_payloads_missing(tmp_path: Path) -> None:
    j = Journal.create(tmp_path / "j", slots=2, slot_bytes=8 << 10)
    live, call = make_call(5, big=6000)  # 12 kB of bf16: over the 8 KiB slot
    j.record(meta_from_call(call, 5), payloads_of(call))
    got = read_journal(j.path).having(SlotState.COMPLETE)
    assert [p is None for p in got[0].payloads] == [False, False, True]
    (path,) = salvage(j.path, tmp_path / "out")
    assert not j.path.exists()
    c = load_bundle(path).calls[0]
    assert c.meta["journal"]["missing_tensors"] == [3]
    assert c.synthesized == [c.tensor_names[3]]  # layout kept, bytes re-created (zeros)
    assert c.storages[c.tensors[3].storage].source is Source.MISSING
    assert c.args[5].dtype == torch.bfloat16 and list(c.args[5].shape) == [6000]
    for got_t, want in zip(c.args[:3], live[:3]):
        assert got_t.stride() == want.stride() and torch.equal(got_t, want)


def test_metadata_too_big_for_a_slot_is_refused(tmp_path: Path) -> None:
    j = Journal.create(tmp_path / "j", slots=2, slot_bytes=1024)
    meta = SlotMeta(call_index=0, target=TARGET, extra={"blob": "x" * 2000})
    with pytest.raises(JournalError, match="raise slot_bytes"):
        j.reserve(meta)
    j.close()


def _journal_with(tmp_path: Path, n: int) -> tuple[Path, dict[int, list[bytes]]]:
    j = Journal.create(tmp_path / "j", slots=6, slot_bytes=16 << 10, process_info={"argv": ["x"]})
    data = {i: record(j, i)[1] for i in range(n)}
    j.close()
    return j.path, data


def _check_trusted(path: Path, data: dict[int, list[bytes]]) -> list[SlotState]:
    """Read a damaged journal: either a JournalError, or complete slots that are exactly what
    was written. Returns the slot states seen."""
    try:
        got = read_journal(path)
    except JournalError:
        return []
    for s in got.having(SlotState.COMPLETE):
        assert list(s.payloads) == data[s.meta.call_index]
    return [s.state for s in got.slots]


def test_truncation_gives_torn_slots_or_a_typed_error(tmp_path: Path) -> None:
    path, data = _journal_with(tmp_path, 5)
    raw = path.read_bytes()
    rng = random.Random(11)
    cuts = [0, 7, 60, 4095, 4096, 4096 + 100, len(raw) - 1] + [
        rng.randrange(len(raw)) for _ in range(40)
    ]
    for cut in cuts:
        path.write_bytes(raw[:cut])
        states = _check_trusted(path, data)
        slot_end = (cut - 4096) // (16 << 10)  # slots wholly inside the cut
        if cut < 4096:
            assert states == []
        else:
            assert states.count(SlotState.COMPLETE) == min(5, slot_end)
            assert states.count(SlotState.TORN) == 6 - min(slot_end, 6)


def test_byte_flips_are_detected(tmp_path: Path) -> None:
    path, data = _journal_with(tmp_path, 3)
    raw = path.read_bytes()
    clean = read_journal(path)
    slot_bytes = clean.header.slot_bytes
    rng = random.Random(5)
    for _ in range(120):
        k = rng.randrange(3)  # slot index k holds call k (seq k + 1)
        base = 4096 + k * slot_bytes
        jlen = int.from_bytes(raw[base + 64 : base + 68], "little")
        head = 72 + 16 * 2 + jlen
        regions = [(0, head), (slot_bytes - 32, slot_bytes)]
        spans = [
            (int.from_bytes(raw[base + 72 + 16 * i : base + 80 + 16 * i], "little"), len(p))
            for i, p in enumerate(data[k])
        ]
        regions += [(off, off + n) for off, n in spans]
        lo, hi = rng.choice(regions)
        pos = base + rng.randrange(lo, hi)
        bad = bytearray(raw)
        bad[pos] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(bad))
        got = read_journal(path)
        by_index = {s.index: s for s in got.slots}
        assert by_index[k].state is not SlotState.COMPLETE, (k, pos - base)
        assert by_index[k].payloads == ()
        for other in {0, 1, 2} - {k}:
            assert by_index[other].state is SlotState.COMPLETE
            assert list(by_index[other].payloads) == data[other]
    for pos in (0, 9, 30, 50, 60):  # the file header is checksummed too
        bad = bytearray(raw)
        bad[pos] ^= 0x40
        path.write_bytes(bytes(bad))
        with pytest.raises(JournalError):
            read_journal(path)


def test_garbage_never_raises_anything_but_journal_error(tmp_path: Path) -> None:
    path, data = _journal_with(tmp_path, 4)
    raw = path.read_bytes()
    rng = random.Random(3)
    for trial in range(30):
        if trial % 3 == 0:
            junk = rng.randbytes(rng.randrange(1, 9000))
        else:  # a valid file header over slots of noise, or noise sprinkled into real slots
            junk = bytearray(raw)
            for _ in range(rng.randrange(1, 200)):
                junk[rng.randrange(4096, len(raw))] = rng.randrange(256)
            junk = bytes(junk) if trial % 3 == 1 else raw[:4096] + rng.randbytes(len(raw) - 4096)
        path.write_bytes(junk)
        _check_trusted(path, data)
    path.write_bytes(raw[:4096] + rng.randbytes(len(raw) - 4096))
    assert {s.state for s in read_journal(path).slots} == {SlotState.TORN}
    with pytest.raises(JournalError, match="no such"):
        read_journal(tmp_path / "absent")
    with pytest.raises(JournalError, match="directory"):
        read_journal(tmp_path)


def _fake_statvfs(free: int) -> object:
    return lambda _path: SimpleNamespace(f_bavail=free // 4096, f_frsize=4096)


def test_ring_shrinks_to_the_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    slot = 64 << 10
    # 20 slots' worth free: the ring may take half, less the header.
    monkeypatch.setattr(jmod.os, "statvfs", _fake_statvfs(20 * slot))
    with caplog.at_level("WARNING", logger="kdump.record.flight.journal"):
        j = Journal.create(tmp_path, slots=64, slot_bytes=slot)
    assert j.slot_count == 9
    assert os.path.getsize(j.path) == 4096 + 9 * slot
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "9 of 64 slots" in lines[0] and "--shm-size" in lines[0]
    j.unlink()
    caplog.clear()
    monkeypatch.setattr(jmod.os, "statvfs", _fake_statvfs(1 << 30))
    with caplog.at_level("WARNING", logger="kdump.record.flight.journal"):
        j = Journal.create(tmp_path, slots=16, slot_bytes=slot)
    assert j.slot_count == 16 and caplog.records == []
    j.unlink()
    monkeypatch.setattr(jmod.os, "statvfs", _fake_statvfs(slot))
    with pytest.raises(JournalError, match="shm-size"):
        Journal.create(tmp_path, slots=4, slot_bytes=slot)
    assert list(tmp_path.iterdir()) == []


def test_salvage_bundles_bitwise_equal(tmp_path: Path) -> None:
    j = Journal.create(tmp_path / "kdump-journal-1", slots=4, slot_bytes=32 << 10)
    lives = {i: record(j, i, stream=5, graph_id=9)[0] for i in range(6)}
    j.close()
    crash = {"signal": 9, "stderr_tail": "CUDA error: an illegal memory access", "traceback": ""}
    paths = salvage(j.path, tmp_path / "out", crash_context=crash)
    assert not j.path.exists()
    names = [p.name.split("-call-")[1][:6] for p in paths]
    assert names == ["000005", "000004", "000003", "000002"]
    for p in paths:
        c = load_bundle(p).calls[0]
        i = c.meta["journal"]["call_index"]
        marks = {k: c.meta["crash"].pop(k) for k in ("at_this_call", "crashed_at")}
        # the process died: its calls still in flight (and the graph's last) are where it may
        # have died, and every bundle names them
        assert marks["at_this_call"] == (p.name in marks["crashed_at"])
        assert paths[0].name in marks["crashed_at"]
        assert c.meta["crash"] == crash and c.meta["journal"]["graph_id"] == 9
        assert c.target == TARGET and c.kwargs == {"mode": "nt"} and c.args[3:5] == [3, 0.5]
        for got, want in zip(c.args[:3], lives[i]):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.stride() == want.stride()
            assert got.storage_offset() == want.storage_offset()
            assert got.numpy().tobytes() == want.numpy().tobytes()
        assert c.args[1].untyped_storage().data_ptr() == c.args[0].untyped_storage().data_ptr()
        assert c.tensors[0].data_ptr == lives[i][0].data_ptr()


WRITER = r"""
import dataclasses, os, random, sys
from kdump.format.journal import SlotMeta
from kdump.record.flight.journal import Journal

path, slots, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def call(i):
    rng = random.Random(i)
    sizes = [rng.randrange(1, 9000) for _ in range(3)]
    storages = [dict(device="cpu", base_ptr=(j + 1) << 20, storage_nbytes=n, span_start=0,
                     span_nbytes=n) for j, n in enumerate(sizes)]
    tensors = [dict(storage=j, dtype="uint8", shape=[n], stride=[1], storage_offset=0,
                    nbytes=n, data_ptr=(j + 1) << 20) for j, n in enumerate(sizes)]
    meta = SlotMeta(call_index=i, target="w:k", storages=storages, tensors=tensors,
                    args=[{"$tensor": 0}, {"$tensor": 1}, {"$tensor": 2}, i])
    return meta, [rng.randbytes(n) for n in sizes]

j = Journal.create(path, slots=slots, slot_bytes=32 << 10)
calls = [call(i) for i in range(24)]  # made up front: the loop's time goes to writing slots
print("ready", flush=True)
i = 0
while count < 0 or i < count:
    meta, data = calls[i % len(calls)]
    meta = dataclasses.replace(meta, call_index=i)  # bytes repeat every 24 calls
    slot = j.reserve(meta)
    for k, d in enumerate(data):
        view = slot.payload(k)
        for off in range(0, len(d), 1024):  # copies land piecewise, like many small D2H copies
            view[off : off + 1024] = d[off : off + 1024]
    slot.commit()
    i += 1
if count >= 0:
    j.reserve(call(i)[0])  # a call in flight when the process dies
    os.kill(os.getpid(), 9)
"""


def _writer_call(i: int) -> tuple[list[int], list[bytes]]:
    rng = random.Random(i % 24)
    sizes = [rng.randrange(1, 9000) for _ in range(3)]
    return sizes, [rng.randbytes(n) for n in sizes]


def _spawn_writer(path: Path, slots: int, count: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(slots), str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_writer_killed_at_random_moments(tmp_path: Path) -> None:
    rng = random.Random(2024)
    seen = {SlotState.COMPLETE: 0, SlotState.IN_FLIGHT: 0, SlotState.TORN: 0}
    bundles = 0
    for trial in range(50):
        path = tmp_path / f"kdump-journal-t{trial}"
        proc = _spawn_writer(path, slots=5, count=-1)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.02))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        proc.stdout.close()
        got = read_journal(path)
        for s in got.slots:
            seen[s.state] = seen.get(s.state, 0) + 1
        complete = got.having(SlotState.COMPLETE)
        for s in complete:
            assert list(s.payloads) == _writer_call(s.meta.call_index)[1]
        indices = [s.meta.call_index for s in complete]
        assert indices == sorted(indices, reverse=True)
        out = tmp_path / f"out{trial}"
        paths = salvage(path, out, {"signal": 9})
        assert len(paths) == len(complete)
        for p in paths:
            c = load_bundle(p).calls[0]
            want = _writer_call(c.meta["journal"]["call_index"])[1]
            assert [t.numpy().tobytes() for t in c.args[:3]] == want
        bundles += len(paths)
    assert bundles > 0 and seen[SlotState.COMPLETE] > 0
    assert seen[SlotState.IN_FLIGHT] + seen[SlotState.TORN] > 0  # some kills landed mid-slot


def test_cli_salvages_the_journal_of_a_dead_process(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = shm / "kdump-journal-dead"
    proc = _spawn_writer(dead, slots=4, count=6)
    out, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL and out == "ready\n"
    live = Journal.create(shm / "kdump-journal-live", slots=2, slot_bytes=16 << 10)
    record(live, 1)  # this process is alive: its journal must stay untouched
    stderr = tmp_path / "stderr.txt"
    stderr.write_text("Traceback ...\nRuntimeError: CUDA error: illegal memory access\n")
    res = CliRunner().invoke(
        cli,
        ["salvage", str(shm), "-o", str(tmp_path / "out"), "--exit-code", "-9", "--stderr", stderr],
    )
    assert res.exit_code == 0, res.output
    assert "3 bundles, 1 in flight, 0 torn" in res.output  # the 4th slot holds call 6
    assert not dead.exists() and live.path.exists()
    bundles = sorted((tmp_path / "out").glob("*.kdump"), reverse=True)
    assert [load_bundle(p).calls[0].meta["journal"]["call_index"] for p in bundles] == [5, 4, 3]
    c = load_bundle(bundles[0]).calls[0]
    assert c.meta["crash"]["signal"] == 9 and "illegal memory" in c.meta["crash"]["stderr_tail"]
    assert [t.numpy().tobytes() for t in c.args[:3]] == _writer_call(5)[1]
    res = CliRunner().invoke(cli, ["salvage", str(live.path), "-o", str(tmp_path / "o2")])
    assert res.exit_code == 0 and "still running" in res.output
    junk = shm / "kdump-journal-junk"
    junk.write_bytes(random.Random(1).randbytes(5000))
    res = CliRunner().invoke(cli, ["salvage", str(junk), "-o", str(tmp_path / "o3")])
    assert isinstance(res.exception, JournalError) and res.exception.exit_code == 2
    live.unlink()


def test_repeated_signature_reuses_its_json_and_reads_back_exactly(tmp_path: Path) -> None:
    """The JSON before `extra` is memoised per argument objects: repeated calls differ only in
    `extra` and in which payloads are present, and each reads back as written."""
    _, call = make_call(5)
    base = meta_from_call(call, call_index=0)
    j = Journal.create(tmp_path, slots=4, slot_bytes=64 << 10)
    metas = []
    for i, want in enumerate(([True, True], [False, True], [True, True])):
        m = SlotMeta(**{**base.__dict__, "call_index": i, "extra": {"i": i, "t": "x" * i}})
        metas.append(m)
        j.reserve(m, want=want).commit()
    got = {s.meta.call_index: s for s in read_journal(j.path).having(SlotState.COMPLETE)}
    for i, m in enumerate(metas):
        assert got[i].meta.extra == m.extra and got[i].meta.args == m.args
        assert got[i].meta.storages == m.storages and got[i].meta.tensors == m.tensors
    assert got[1].payloads[0] is None and got[0].payloads[0] is not None
    j.close()


def test_crc_shift_gives_the_crc_from_another_start_value() -> None:
    """`_CrcShift`: crc32(body, b) from crc32(body, a) by table lookups, for any body of its
    length (the template path's second checksum without a second pass)."""
    rng = random.Random(7)
    for n in (0, 1, 5, 64, 1000, 4099):
        shift = jmod._CrcShift(n)
        for _ in range(20):
            body = rng.randbytes(n)
            a, b = rng.getrandbits(32), rng.getrandbits(32)
            assert shift(jmod.zlib.crc32(body, a), a, b) == jmod.zlib.crc32(body, b)


def test_a_template_slot_is_the_slot_reserve_writes(tmp_path: Path) -> None:
    """`reserve_from` writes the bytes `reserve` writes for the same call: header, payload
    table, JSON and (after commit, either way) trailer; also after its JSON length changes."""
    _, call = make_call(3)
    base = meta_from_call(call, call_index=0)
    hole = 7_319_846_250_183_746_000
    tmeta = SlotMeta(**{**base.__dict__, "extra": {"call_index": hole, "time_ns": hole + 1}})
    want = [True, False]

    def meta(index: int, t: int) -> SlotMeta:
        return SlotMeta(
            **{**base.__dict__, "call_index": index, "extra": {"call_index": index, "time_ns": t}}
        )

    a = Journal.create(tmp_path / "a.jrnl", slots=4, slot_bytes=64 << 10)
    b = Journal.create(tmp_path / "b.jrnl", slots=4, slot_bytes=64 << 10)
    tpl = b.template(tmeta, want, [hole, hole + 1], (meta(1, 5), [1, 5]))
    assert tpl is not None
    for index, t, device in ((7, 123, False), (8, 124, True), (1234567, 10**18, False)):
        sa = a.reserve(meta(index, t), want=want)
        sb = b.reserve_from(tpl, [index, t], 0, index)
        assert sb is not None and (sa.index, sa.seq, sa.spans) == (sb.index, sb.seq, sb.spans)
        for s in (sa, sb):
            s.commit(device=device)
            s.finish()
        lo, hi = sa.offset, sa.offset + a.slot_bytes
        assert bytes(a._view[lo:hi]) == bytes(b._view[lo:hi])
    got = read_journal(b.path).having(SlotState.COMPLETE)  # 8: its device copies never ran
    assert sorted(s.meta.call_index for s in got) == [7, 1234567]
    a.close()
    b.close()
