"""Storages written in pieces (format version 5): every write path splits a storage larger than
the piece size into blobs of their own, hashed and written in one pass; every reader puts them
back together; the shared store keeps one file per piece."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from kdump.bundle import (
    BlobStore,
    attach_outputs,
    capture_call,
    input_tensors,
    load_bundle,
    pack,
    save_calls,
)
from kdump.bundle.spool import StoreSpool
from kdump.bundle.store import Pieces, piece_bytes, piece_cuts, sha256_hex, span_digests
from kdump.bundle.writer import open_spool
from kdump.errors import UsageError
from kdump.format.records import Source

MIB = 1 << 20


@pytest.fixture(autouse=True)
def one_mib_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDUMP_PIECE_BYTES", "1M")


def _rand(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _manifest(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return header, json.loads(header["__metadata__"]["kdump.manifest"])


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _check_pieces(st: dict[str, Any], span: int) -> None:
    assert st["source"] == "pieces" and st["blob"] == ""
    sizes = [n for _, n in st["pieces"]]
    assert sizes == [n for lo, hi in piece_cuts(span, MIB) for n in [hi - lo]]


def test_piece_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert piece_bytes() == MIB
    monkeypatch.setenv("KDUMP_PIECE_BYTES", "3M")
    assert piece_bytes() == 3 * MIB
    for bad in ("512K", "1.5M", "0"):
        monkeypatch.setenv("KDUMP_PIECE_BYTES", bad)
        with pytest.raises(UsageError, match="KDUMP_PIECE_BYTES"):
            piece_bytes()
    monkeypatch.delenv("KDUMP_PIECE_BYTES")
    assert piece_bytes() == 16 * MIB
    assert piece_cuts(5, 4) == [(0, 4), (4, 5)] and piece_cuts(4, 4) == [(0, 4)]


@pytest.mark.parametrize("mb", [3, 12])  # assembled in memory; hashed and written by the pool
def test_bundle_of_pieces_round_trips(tmp_path: Path, mb: int) -> None:
    big = _rand(mb * MIB // 4 + 77, seed=1)
    small = torch.arange(100, dtype=torch.int32)
    args = [big[9:].view(-1)[: big.numel() - 9], small, big]
    rec = capture_call("m:f", args, {})
    path = save_calls(tmp_path / "b.kdump", [rec])
    header, m = _manifest(path)
    assert m["version"] >= 5
    st = m["calls"][0]["storages"][0]
    _check_pieces(st, big.numel() * 4)
    for sha, _ in st["pieces"]:  # each piece a blob of its own, at its place in the file
        assert sha in header and m["blobs"][sha]["nbytes"] == header[sha]["shape"][0]
    offs = [header[sha]["data_offsets"] for sha, _ in st["pieces"]]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(offs))  # back to back: one map loads it
    b = load_bundle(path)
    b.verify()
    got = b.calls[0].materialize("cpu").tensors
    assert _bits(got[0]) == _bits(args[0]) and got[0].storage_offset() == 9
    assert torch.equal(got[1], small)
    assert got[2].untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()
    assert _bits(got[2]) == _bits(big)
    # through the copying path too (a placement that cannot use the file's pages)
    from kdump.bundle.materialize import Placement

    halo = b.calls[0].materialize("cpu", Placement(halo=64)).tensors
    assert _bits(halo[2]) == _bits(big)


def test_equal_pieces_are_one_blob(tmp_path: Path) -> None:
    z = torch.zeros(5 * MIB // 4, dtype=torch.float32)
    rec = capture_call("m:f", [z], {})
    path = save_calls(tmp_path / "z.kdump", [rec])
    _, m = _manifest(path)
    st = m["calls"][0]["storages"][0]
    assert len(st["pieces"]) == 5 and len({sha for sha, _ in st["pieces"]}) == 1
    assert len(m["blobs"]) == 1
    got = load_bundle(path).calls[0].materialize("cpu").tensors[0]
    assert torch.equal(got, z)


def test_dump_call_writes_pieces_hashed_on_the_way(tmp_path: Path) -> None:
    """dump_call's spool: the spans go from the arguments into the file in pieces; an output the
    call left unchanged shares the pieces of its input."""
    import kdump

    x = _rand(10 * MIB // 4, seed=2)
    out = _rand(9 * MIB // 4 + 3, seed=3)

    def fn(a: torch.Tensor, o: torch.Tensor) -> None:
        o[: 2 * MIB // 4].mul_(2.0)  # the first two pieces change, the rest do not

    before = out.clone()
    path = tmp_path / "d.kdump"
    kdump.dump_call(path, fn, x, out)
    _header, m = _manifest(path)
    call = m["calls"][0]
    _check_pieces(call["storages"][0], x.numel() * 4)
    outs = call["outputs"]["storages"]
    assert len(outs) == 2
    ins = {st["base_ptr"]: st for st in call["storages"]}
    for st in outs:
        _check_pieces(st, ins[st["base_ptr"]]["span_nbytes"])
    b = load_bundle(path)
    b.verify()
    c = b.calls[0]
    got = c.materialize("cpu").tensors
    assert torch.equal(got[0], x) and torch.equal(got[1], before)
    assert torch.equal(c.outputs["o"], out)
    unchanged = next(st for st in outs if st["base_ptr"] == x.data_ptr())
    assert unchanged["pieces"] == ins[x.data_ptr()]["pieces"]
    changed = next(st for st in outs if st["base_ptr"] == out.data_ptr())
    old = ins[out.data_ptr()]["pieces"]
    same = [a == b for a, b in zip(changed["pieces"], old)]
    assert same == [False, False] + [True] * (len(old) - 2)


def test_large_unchanged_outputs_are_compared_by_their_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans from 16 MiB are compared with what the spool wrote by the pieces' fast check
    digests (the live bytes read once): a change in the last bytes is still found."""
    import kdump
    from kdump.bundle import store

    pytest.importorskip("xxhash")
    asked: list[bool | None] = []
    real = store.same_as_digests

    def spy(items: Any, first: Any = None) -> list[bool | None]:
        got = real(items, first)
        asked.extend(got)
        return got

    monkeypatch.setattr(store, "same_as_digests", spy)
    x = _rand(20 * MIB // 4, seed=4)
    out = _rand(18 * MIB // 4 + 5, seed=5)

    def fn(a: torch.Tensor, o: torch.Tensor) -> None:
        o[-1:].add_(1.0)  # the last element only: past the first compared bytes

    path = tmp_path / "d.kdump"
    kdump.dump_call(path, fn, x, out)
    assert sorted(asked, key=str) == [False, True], asked
    _header, m = _manifest(path)
    call = m["calls"][0]
    ins = {st["base_ptr"]: st for st in call["storages"]}
    outs = {st["base_ptr"]: st for st in call["outputs"]["storages"]}
    assert outs[x.data_ptr()]["pieces"] == ins[x.data_ptr()]["pieces"]
    changed = [
        a == b for a, b in zip(outs[out.data_ptr()]["pieces"], ins[out.data_ptr()]["pieces"])
    ]
    assert changed == [True] * (len(changed) - 1) + [False]
    b = load_bundle(path)
    b.verify()
    assert torch.equal(b.calls[0].outputs["o"], out)


def test_dump_call_after_interpreter_shutdown_began(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An atexit handler's call: no pool takes new work, so the spool hashes and writes, and
    the output compare hashes, on the calling thread; the bundle is the same."""
    import concurrent.futures.thread as cft

    import kdump

    x = _rand(20 * MIB // 4, seed=6)
    out = _rand(18 * MIB // 4, seed=7)

    def fn(a: torch.Tensor, o: torch.Tensor) -> None:
        o[-1:].add_(1.0)

    monkeypatch.setattr(cft, "_shutdown", True)
    path = tmp_path / "late.kdump"
    kdump.dump_call(path, fn, x, out)
    # a bundle written from memory (a flight recorder's flush at exit) and a verified load
    again = save_calls(tmp_path / "mem.kdump", [capture_call("m:f", [x, out], {})])
    load_bundle(again).verify()
    b = load_bundle(path)
    b.verify()
    monkeypatch.setattr(cft, "_shutdown", False)
    got = b.calls[0]
    assert torch.equal(got.materialize("cpu").tensors[0], x)
    assert torch.equal(got.outputs["o"], out)
    _header, m = _manifest(path)
    call = m["calls"][0]
    ins = {st["base_ptr"]: st for st in call["storages"]}
    outs = {st["base_ptr"]: st for st in call["outputs"]["storages"]}
    assert outs[x.data_ptr()]["pieces"] == ins[x.data_ptr()]["pieces"]
    assert outs[out.data_ptr()]["pieces"][-1] != ins[out.data_ptr()]["pieces"][-1]


def test_spool_view_is_the_snapshot(tmp_path: Path) -> None:
    """The spool's view of a pieced span is the bytes as written, not the live tensor."""
    x = _rand(3 * MIB // 4 + 5, seed=4)
    spool = open_spool(tmp_path / "s.kdump")
    try:
        [(view, named)] = spool.put([x.view(torch.uint8)], [0])
        assert isinstance(named, Pieces) and named.size == MIB and len(named.digests) == 4
        data = _bits(x)
        assert [d[0] for d in named.digests] == [
            sha256_hex(data[lo:hi]) for lo, hi in piece_cuts(len(data), MIB)
        ]
        x.zero_()
        assert bytes(view.numpy()) == data
    finally:
        spool.abort()


def test_store_keeps_one_file_per_piece_and_a_changed_piece_alone(tmp_path: Path) -> None:
    capdir = tmp_path / "cap"
    store = BlobStore(capdir)
    w = _rand(4 * MIB // 4, seed=5)
    save_calls(capdir / "a.kdump", [capture_call("m:f", [w], {})], store=store, inline_below=1)
    files = {p.name for p in (capdir / "blobs").rglob("*") if p.is_file()}
    assert len(files) == 4
    w[MIB // 4 + 1] += 1.0  # one byte range of piece 1 changes
    path = save_calls(
        capdir / "b.kdump", [capture_call("m:f", [w], {})], store=store, inline_below=1
    )
    after = {p.name for p in (capdir / "blobs").rglob("*") if p.is_file()}
    assert len(after - files) == 1
    _, m = _manifest(path)
    assert all(b["where"] == "store" for b in m["blobs"].values())
    b = load_bundle(path)
    b.verify()
    assert torch.equal(b.calls[0].materialize("cpu").tensors[0], w)
    packed = pack(path, tmp_path / "packed.kdump")
    header, pm = _manifest(packed)
    st = pm["calls"][0]["storages"][0]
    offs = [header[sha]["data_offsets"] for sha, _ in st["pieces"]]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(offs))
    assert all(b["where"] == "inline" for b in pm["blobs"].values())
    assert torch.equal(load_bundle(packed).calls[0].materialize("cpu").tensors[0], w)


def test_store_spool_joins_the_piece_files_into_one_snapshot(tmp_path: Path) -> None:
    """Sync recording into a capture directory: each piece a store file of its own, the
    snapshot one range of addresses over them."""
    capdir = tmp_path / "cap"
    sink = StoreSpool(lambda: BlobStore(capdir), 16 << 10)
    x = _rand(5 * MIB // 4 + 11, seed=6)
    [(view, named)] = sink.put([x.view(torch.uint8)], [0])
    data = _bits(x)
    assert isinstance(named, Pieces) and len(named.digests) == 6
    assert set(sink.created) == {d[0] for d in named.digests}
    x.zero_()
    assert bytes(view.numpy()) == data
    view[0] = 7  # private: the store file keeps its bytes
    first = BlobStore(capdir).path(named.digests[0][0]).read_bytes()
    assert first == data[:MIB]


def test_sync_recording_of_a_large_call_into_a_capture_directory(tmp_path: Path) -> None:
    import sys
    import types

    import kdump

    mod = types.ModuleType("kdump_pieces_target")

    def scale(a: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(a * 2)

    scale.__module__ = mod.__name__
    scale.__qualname__ = "scale"
    mod.scale = scale  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        a = _rand(12 * MIB // 4, seed=7)
        out = torch.empty_like(a)
        with kdump.recording(f"{mod.__name__}:scale", out=tmp_path / "rec") as rec:
            mod.scale(a, out)
        [path] = rec.written
        b = load_bundle(path)
        b.verify()
        c = b.calls[0]
        assert c.storages[0].source is Source.PIECES
        assert torch.equal(c.materialize("cpu").tensors[0], a)
        assert torch.equal(c.outputs["out"], a * 2)
    finally:
        del sys.modules[mod.__name__]


def test_span_digests_match_the_writer(tmp_path: Path) -> None:
    x = _rand(2 * MIB // 4 + 1, seed=8)
    named = span_digests(memoryview(x.numpy()).cast("B"))
    assert isinstance(named, Pieces) and len(named.digests) == 3
    assert span_digests(memoryview(b"abc"))[0] == sha256_hex(b"abc")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from kdump.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err


def test_info_and_diff_read_pieces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = _rand(3 * MIB // 4, seed=9)
    a = save_calls(tmp_path / "a.kdump", [capture_call("m:f", [x], {})])
    y = x.clone()
    y[5] += 1
    b = save_calls(tmp_path / "b.kdump", [capture_call("m:f", [y], {})])
    code, out = _cli(capsys, "info", "--verify", str(a))
    # the summary wraps at the terminal's width, where depends on the path's length
    assert code == 0 and "checksums OK" in " ".join(out.split()) and "pieces" in out, out
    code, out = _cli(capsys, "diff", str(a), str(a))
    assert code == 0, out
    code, out = _cli(capsys, "diff", str(a), str(b))  # diff compares layouts, not values
    assert code == 0 and "identical" in out, out


def test_outputs_capture_with_input_pieces(tmp_path: Path) -> None:
    x = _rand(2 * MIB // 4 + 9, seed=10)
    args = [x]
    rec = capture_call("m:f", args, {})
    live = input_tensors(rec, args, {})
    x.add_(1.0)
    attach_outputs(rec, live, [0])
    path = save_calls(tmp_path / "o.kdump", [rec])
    c = load_bundle(path).calls[0]
    assert c.output_storages[0].source is Source.PIECES
    assert torch.equal(c.outputs["args[0]"], x)


@pytest.mark.gpu
def test_gpu_dump_call_writes_device_spans_in_pieces(tmp_path: Path) -> None:
    """Each piece of a device span staged, hashed and written by a worker of its own, after the
    work queued on the caller's stream; an unchanged output shares its input's pieces."""
    import kdump

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = _rand(5 * MIB // 4 + 3, seed=11).cuda()
        x.mul_(-1)  # produced on a side stream, not synchronised
        out = torch.zeros(3 * MIB // 4, device="cuda")
        before = x.cpu()

        def fn(a: torch.Tensor, o: torch.Tensor) -> None:
            o.add_(1)

        path = tmp_path / "g.kdump"
        kdump.dump_call(path, fn, x, out)
    b = load_bundle(path)
    b.verify()
    c = b.calls[0]
    assert [st.source for st in c.storages] == [Source.PIECES, Source.PIECES]
    got = c.materialize("cpu").tensors
    assert torch.equal(got[0], before) and torch.equal(got[1], torch.zeros(3 * MIB // 4))
    outs = c.outputs
    assert torch.equal(outs["o"], torch.ones(3 * MIB // 4))
    unchanged = next(st for st in c.output_storages if st.base_ptr == x.data_ptr())
    assert unchanged.pieces == c.storages[0].pieces


@pytest.mark.gpu
def test_gpu_sync_recording_into_the_store_in_pieces(tmp_path: Path) -> None:
    capdir = tmp_path / "cap"
    sink = StoreSpool(lambda: BlobStore(capdir), 16 << 10)
    x = _rand(3 * MIB // 4 + 5, seed=12).cuda()
    [(view, named)] = sink.put([x.view(torch.uint8)], [0])
    assert isinstance(named, Pieces) and len(named.digests) == 4
    assert bytes(view.numpy()) == _bits(x.cpu())


def test_allocated_range_keeps_what_the_file_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer allocates a large span's range before writing it: the file reads the same as
    one written without (the gap before the span a hole of zeros), and where the system cannot
    allocate, the write goes on as before."""
    import os

    from kdump.bundle import fileio

    data = bytes(range(256)) * (2 * MIB // 256) + b"tail"
    assert len(data) >= fileio.ALLOCATE_MIN
    at = 4096 + 5
    fd = os.open(tmp_path / "empty.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fileio.allocate(fd, 0, 3 * MIB):
            assert os.fstat(fd).st_size == 3 * MIB
            assert os.pread(fd, 3 * MIB, 0) == bytes(3 * MIB)
    finally:
        os.close(fd)
    monkeypatch.setattr(fileio, "allocation_helps", lambda fd: True)  # whatever tmp_path is on
    for name, fallocate in (("with", fileio._allocate), ("without", None)):
        monkeypatch.setattr(fileio, "_allocate", fallocate)
        path = tmp_path / f"{name}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fileio.write_groups(fd, memoryview(data), at)
        finally:
            os.close(fd)
        assert path.read_bytes() == bytes(at) + data


def test_write_and_hash_writes_in_order_and_names_every_piece(tmp_path: Path) -> None:
    """The spool's CPU path: the calling thread writes the spans in order while the pool hashes
    the pieces (largest first, not in the order given); each piece gets its own digests, in the
    order given, and the file holds every span at its offset."""
    import os

    from kdump.bundle.fileio import write_and_hash
    from kdump.bundle.store import blob_digests

    spans = [os.urandom(n) for n in (3 * MIB + 7, 5 * MIB, MIB + 1, 2 * MIB)]
    offsets, pos = [], 0
    for s in spans:
        offsets.append(pos)
        pos += len(s) + 4096  # a gap after each span
    views = [memoryview(s) for s in spans]
    pieces = [v[lo:hi] for v in views for lo, hi in piece_cuts(len(v), 2 * MIB)]
    assert sorted(map(len, pieces), reverse=True) != list(map(len, pieces))
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        got = write_and_hash(fd, list(zip(views, offsets)), pieces)
    finally:
        os.close(fd)
    assert got == [blob_digests(p) for p in pieces]
    raw = path.read_bytes()
    for s, at in zip(spans, offsets):
        assert raw[at : at + len(s)] == s
    # a write that fails is reported (after every hashing worker finished)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            write_and_hash(fd, list(zip(views, offsets)), pieces)
    finally:
        os.close(fd)


def test_large_output_compare_reads_the_first_bytes_exactly() -> None:
    """A large output compared by its digests has its first bytecmp.PIECE bytes compared with
    the snapshot by memcmp too: the first EARLY bytes before the digests are asked for, the
    rest by the job hashing the first piece. Here the digests are those of the live bytes, so
    only that memcmp can see the snapshot differ."""
    pytest.importorskip("xxhash")
    from kdump.bundle import bytecmp, capture
    from kdump.bundle.fileio import cpu_view

    n = bytecmp.SPLIT_MIN + 3 * MIB
    live = torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9)
    )
    digests = span_digests(cpu_view(live))  # pieces of 1 MiB (the fixture)
    assert isinstance(digests, Pieces)
    for at, same in (
        (None, True),
        (10, False),
        (capture.EARLY + 3, False),
        (MIB + 1, False),
        (bytecmp.PIECE - 1, False),
    ):
        snapshot = live.clone()
        if at is not None:
            snapshot[at] ^= 1
        earlier = capture.Captured(storages=[], tensors=[], data=[snapshot], digests=[digests])
        assert capture._same_as_written(earlier, [live], [(0, 0)]) == [same], at


def test_allocation_only_where_it_helps(tmp_path: Path) -> None:
    """Large spans are allocated before their write on ext4 (where it was measured to help),
    not on tmpfs (where it costs more)."""
    import os

    from kdump.bundle import fileio

    fd = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        kind = fileio._fs_type(fd)
        assert fileio.allocation_helps(fd) == (
            fileio._allocate is not None and kind in fileio.ALLOCATING_FS
        )
    finally:
        os.close(fd)
    if os.path.isdir("/dev/shm"):
        fd = os.open(f"/dev/shm/kdump-probe-{os.getpid()}", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if fileio._fs_type(fd) == 0x01021994:  # tmpfs
                assert not fileio.allocation_helps(fd)
        finally:
            os.close(fd)
            os.unlink(f"/dev/shm/kdump-probe-{os.getpid()}")
