"""Fast bundle I/O: aligned blobs, copy-on-write views of the file, verification on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdump.bundle import capture_call, load_bundle, save_calls
from kdump.bundle.materialize import Placement
from kdump.errors import BundleError
from kdump.format.records import ALIGN_MOD

GEN = torch.Generator().manual_seed(99)


def _mapped_file(ptr: int) -> str | None:
    """The file mapped at address `ptr` in this process ("" for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    return None


def _bundle(tmp_path: Path) -> tuple[Path, list[torch.Tensor]]:
    big = torch.randn(256, 512, generator=GEN)  # 512 KiB: laid out at its recorded alignment
    other = torch.randint(-(2**31), 2**31 - 1, (64, 1024), dtype=torch.int32, generator=GEN)
    args = [big, big[:, :256], other[1:], torch.randn(7, generator=GEN)]
    return save_calls(tmp_path / "b.kdump", [capture_call("m:f", args)]), args


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_default_cpu_load_is_a_private_view_of_the_file(tmp_path: Path) -> None:
    path, args = _bundle(tmp_path)
    bundle = load_bundle(path)
    first = bundle.calls[0].materialize("cpu")
    big = first.tensors[0]
    assert _mapped_file(big.data_ptr()) == str(path.resolve())  # zero-copy
    assert big.data_ptr() % ALIGN_MOD == args[0].data_ptr() % ALIGN_MOD
    assert first.tensors[1].untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    # A view deeper into its storage (a prefix to re-create) is a copy, still exact.
    assert first.tensors[2].storage_offset() == args[2].storage_offset()
    assert _mapped_file(first.tensors[2].data_ptr()) != str(path.resolve())
    for got, want in zip(first.tensors, args):
        assert torch.equal(got, want) and got.stride() == want.stride()
    # Writes stay private: not in the file, not in a second load of the same blob.
    before = path.read_bytes()
    big.fill_(3.0)
    second = bundle.calls[0].materialize("cpu")
    assert torch.equal(second.tensors[0], args[0])
    assert path.read_bytes() == before
    assert torch.equal(load_bundle(path).calls[0].args[0], args[0])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_halo_and_flush_placements_copy(tmp_path: Path) -> None:
    path, args = _bundle(tmp_path)
    call = load_bundle(path).calls[0]
    for placement in (Placement(halo=64), Placement(flush_end=True)):
        mc = call.materialize("cpu", placement)
        assert _mapped_file(mc.tensors[0].data_ptr()) != str(path.resolve())
        assert torch.equal(mc.tensors[0], args[0])


def _corrupt_big_blob(path: Path) -> None:
    bundle = load_bundle(path)
    sha = bundle.calls[0].storages[0].blob
    begin, _ = bundle.inline[sha]
    raw = bytearray(path.read_bytes())
    raw[bundle.data_start + begin + 1000] ^= 0x10
    path.write_bytes(bytes(raw))


def test_zero_copy_view_is_verified_and_no_verify_skips_it(tmp_path: Path) -> None:
    path, args = _bundle(tmp_path)
    _corrupt_big_blob(path)
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(path).calls[0].materialize("cpu")
    unchecked = load_bundle(path, verify=False)
    got = unchecked.calls[0].materialize("cpu").tensors[0]
    assert not torch.equal(got, args[0])  # the corrupt byte is handed out unchecked
    assert torch.equal(got.flatten()[251:], args[0].flatten()[251:])
    with pytest.raises(BundleError, match="checksum mismatch"):
        unchecked.verify()  # an explicit verify still checks


def test_verified_blobs_pass_on_to_another_process_bundle(tmp_path: Path) -> None:
    path, args = _bundle(tmp_path)
    parent = load_bundle(path)
    parent.calls[0].materialize("cpu")
    done = parent.verified
    assert done == {s.blob for s in parent.calls[0].storages}
    child = load_bundle(path)
    _corrupt_big_blob(path)  # a child that trusts the parent does not hash again
    child.trust(done)
    got = child.calls[0].materialize("cpu").tensors[0]
    assert not torch.equal(got, args[0])
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(path).calls[0].materialize("cpu")


def test_blobs_sit_at_their_recorded_alignment_in_the_file(tmp_path: Path) -> None:
    path, _ = _bundle(tmp_path)
    bundle = load_bundle(path)
    assert bundle.data_start % ALIGN_MOD == 0
    for st in bundle.calls[0].storages:
        begin, end = bundle.inline[st.blob]
        assert end - begin == st.span_nbytes
        if st.span_nbytes >= 64 << 10:
            assert (bundle.data_start + begin) % ALIGN_MOD == st.alignment


def test_kdump_info_end_to_end_imports_no_torch(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    path, _ = _bundle(tmp_path)
    code = (
        "import sys\n"
        "from kdump.cli import main\n"
        "try:\n"
        f"    main(['info', '--verify', '--json', {str(path)!r}])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep[0]["verified"] is True if isinstance(rep, list) else rep["verified"] is True


def test_unchanged_output_shares_its_input_snapshot(tmp_path: Path) -> None:
    from kdump.bundle import attach_outputs, input_tensors

    x, y = torch.randn(300, 200, generator=GEN), torch.randn(300, 200, generator=GEN)
    call = capture_call("m:f", [x, y])
    y.mul_(2)  # y changed, x did not
    attach_outputs(call, input_tensors(call, [x, y], {}), [0, 1])
    assert call.outputs.data[0] is call.inputs.data[0]  # compared, not copied
    assert call.outputs.data[1] is not call.inputs.data[1]
    path = save_calls(tmp_path / "o.kdump", [call])
    loaded = load_bundle(path).calls[0]
    outs = loaded.materialize_outputs("cpu")
    assert torch.equal(outs[0], x) and torch.equal(outs[1], y)
    assert torch.equal(loaded.args[1], y / 2)


# ---------------------------------------------------------------------------------------------
# Snapshots written straight into the bundle file (kdump.bundle.spool)


def _temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def _large_call(device: str = "cpu") -> list[torch.Tensor]:
    """A call over the spool threshold: mixed dtypes, a view with a storage offset, a shared
    storage, a transposed view, a tiny tensor, and two storages holding the same bytes."""
    from kdump.bundle.capture import SINK_MIN

    n = SINK_MIN // 4 + 4099  # not a multiple of any chunk size
    a = torch.randn(n, generator=GEN)
    b = torch.randint(-(2**31), 2**31 - 1, (777, 1025), dtype=torch.int32, generator=GEN)
    twin = torch.arange(300_000, dtype=torch.float32)
    tensors = [a, b, twin.clone(), twin.clone(), torch.randn(5, generator=GEN)]
    tensors = [t.to(device) for t in tensors]
    a, b = tensors[0], tensors[1]
    return [*tensors, a[7:], b.t(), b[3:, 5:]]


def _check_round_trip(
    path: Path, live: list[torch.Tensor], before: list[torch.Tensor], after: list[torch.Tensor]
) -> None:
    """The bundle at `path` holds the call on `live` (its layouts), with values `before` as
    inputs and `after` as outputs, bit for bit."""
    bundle = load_bundle(path)
    bundle.verify()
    call = bundle.calls[0]
    got = call.materialize("cpu").tensors
    for g, layout, want in zip(got, live, before):
        assert g.dtype == layout.dtype and g.stride() == layout.stride()
        assert g.storage_offset() == layout.storage_offset()
        assert torch.equal(g, want.cpu())
    outs = call.materialize_outputs("cpu")
    assert sorted(outs) == list(range(len(after)))
    for i, g in outs.items():
        assert torch.equal(g, after[i].cpu())
    seen: set[str] = set()
    for st in call.storages:
        begin, end = bundle.inline[st.blob]
        assert end - begin == st.span_nbytes
        if st.span_nbytes >= 64 << 10 and st.blob not in seen:  # a shared blob: the first's
            assert (bundle.data_start + begin) % ALIGN_MOD == st.alignment
        seen.add(st.blob)


def test_dump_call_writes_its_snapshot_into_the_bundle_file(tmp_path: Path) -> None:
    import kdump

    args = _large_call()
    before = [t.clone() for t in args]

    def kernel(*xs: torch.Tensor) -> None:
        xs[1].add_(1)  # one output changes; the others are written once, shared with inputs

    path = tmp_path / "big.kdump"
    kdump.dump_call(path, kernel, *args)
    _check_round_trip(path, args, before, args)
    assert _temporaries(tmp_path) == []
    m = load_bundle(path).manifest
    # a, b before, b after, the twins once, the tiny tensor: nothing stored twice.
    assert len(m.blobs) == 5
    payload = sum(b.nbytes for b in m.blobs.values())
    assert path.stat().st_size < payload + (512 << 10)


def test_a_call_that_raises_keeps_its_spooled_inputs(tmp_path: Path) -> None:
    import kdump

    args = _large_call()
    before = [t.clone() for t in args]

    def kernel(*xs: torch.Tensor) -> None:
        xs[0].zero_()
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        kdump.dump_call(tmp_path / "e.kdump", kernel, *args)
    call = load_bundle(tmp_path / "e.kdump").calls[0]
    assert "kernel failed" in call.meta["exception"]
    assert torch.equal(call.materialize("cpu").tensors[0], before[0])
    assert _temporaries(tmp_path) == []


@pytest.mark.parametrize("in_kernel", [True, False])
def test_a_header_that_outgrows_its_reserved_space_moves_the_data(
    tmp_path, monkeypatch, in_kernel
) -> None:
    import os

    from kdump.bundle import attach_outputs, input_tensors, spool
    from kdump.bundle.writer import open_spool

    if not in_kernel:  # a sandbox without copy_file_range: moved through a buffer

        def unsupported(*args: object) -> int:
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "copy_file_range", unsupported)
    monkeypatch.setattr(spool, "RESERVE_MIN", 0)
    monkeypatch.setattr(spool, "RESERVE_PER_RECORD", 0)
    args = _large_call()
    before = [t.clone() for t in args]
    path = tmp_path / "moved.kdump"
    sink = open_spool(path)
    call = capture_call("m:f", args, sink=sink, meta={"note": "x" * 5000})
    assert sink.active and sink.data_start == 0
    args[2].mul_(3)
    attach_outputs(call, input_tensors(call, args, {}), range(len(args)), sink=sink)
    save_calls(path, [call], spool=sink)
    _check_round_trip(path, args, before, args)
    assert load_bundle(path).data_start % ALIGN_MOD == 0
    assert _temporaries(tmp_path) == []


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch) -> None:
    from kdump.bundle import writer

    args = _large_call()
    path = tmp_path / "f.kdump"
    sink = writer.open_spool(path)
    call = capture_call("m:f", args, sink=sink)
    assert _temporaries(tmp_path)  # the snapshot is in the bundle's temporary already

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "header_json", broken)
    with pytest.raises(OSError, match="disk full"):
        save_calls(path, [call], spool=sink)
    assert not path.exists() and _temporaries(tmp_path) == []
    # The snapshot's bytes stay readable after the file is gone (private views of it).
    assert torch.equal(call.inputs.data[0].view(torch.float32), args[0])


def test_a_killed_writer_leaves_a_temporary_that_the_next_recording_removes(tmp_path) -> None:
    import subprocess
    import sys

    from kdump.record.capture_dir import remove_stale_temporaries

    code = (
        "import os, sys, torch\n"
        "from kdump.bundle.capture import capture_call\n"
        "from kdump.bundle.writer import open_spool\n"
        "sink = open_spool(sys.argv[1])\n"
        "capture_call('m:f', [torch.zeros(3 << 20)], sink=sink)\n"
        "os._exit(0)\n"  # killed before the header: no rename, no clean-up
    )
    path = tmp_path / "k.kdump"
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not path.exists()
    left = _temporaries(tmp_path)
    assert len(left) == 1
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == left
    assert _temporaries(tmp_path) == []


def test_save_calls_reuses_the_capture_digests(tmp_path, monkeypatch) -> None:
    """A spooled capture written elsewhere (another path, a store) is not hashed again."""
    from kdump.bundle import BlobStore, store, writer

    args = _large_call()
    sink = writer.open_spool(tmp_path / "first.kdump")
    call = capture_call("m:f", args, sink=sink)
    sink.abort()
    calls = []
    real = store.blob_digests
    monkeypatch.setattr(writer, "blob_digests", lambda v: calls.append(len(v)) or real(v))
    path = save_calls(tmp_path / "cap" / "s.kdump", [call], store=BlobStore(tmp_path / "cap"))
    assert calls == []
    got = load_bundle(path).calls[0].materialize("cpu").tensors
    assert all(torch.equal(g, w) for g, w in zip(got[:2], args[:2]))


def test_sync_recording_keeps_small_blobs_inline_and_large_ones_in_the_store(tmp_path) -> None:
    import sys
    import types

    import kdump
    from kdump.format.records import Where

    mod = types.ModuleType("kdump_io_target")

    def step(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x * 2)

    step.__module__, step.__qualname__ = mod.__name__, "step"
    mod.step = step  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    weight = torch.randn(64 << 10, generator=GEN)  # 256 KiB, the same in every call
    try:
        with kdump.recording(f"{mod.__name__}:step", out=tmp_path) as rec:
            for i in range(3):
                mod.step(weight, torch.full((16,), float(i)), torch.empty(16))
    finally:
        del sys.modules[mod.__name__]
    assert len(rec.written) == 3
    stored = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    assert len(stored) == 1 and stored[0].stat().st_size == weight.numel() * 4
    for i, path in enumerate(rec.written):
        bundle = load_bundle(path)
        bundle.verify()
        wheres = {b.where for b in bundle.manifest.blobs.values()}
        assert wheres == {Where.INLINE, Where.STORE}
        call = bundle.calls[0]
        assert torch.equal(call.args[1], torch.full((16,), float(i)))
        assert torch.equal(call.materialize_outputs("cpu")[2], torch.full((16,), 2.0 * i))
    folder = rec.written[0].parent
    assert _temporaries(folder) == [] and _temporaries(tmp_path / "blobs") == []
    assert all(p.stat().st_size > 0 for p in folder.glob("*.kdump"))


# ---------------------------------------------------------------------------------------------
# GPU: device spans staged through pinned buffers


@pytest.mark.gpu
def test_gpu_dump_call_stages_spans_in_chunks(tmp_path, monkeypatch) -> None:
    import kdump
    from kdump.bundle import staging

    monkeypatch.setattr(staging, "STAGE_CHUNK", (1 << 20) + 4096)  # many chunks, a ragged last one
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # produced on a side stream, not synchronised: the capture
        args = _large_call("cuda")  # must order its copies after this work
        args[0].mul_(-1)
        before = [t.cpu() for t in args]

        def kernel(*xs: torch.Tensor) -> None:
            xs[1].add_(1)

        path = tmp_path / "gpu.kdump"
        kdump.dump_call(path, kernel, *args)
        after = [t.cpu() for t in args]
    _check_round_trip(path, args, before, after)
    m = load_bundle(path).manifest
    assert len(m.blobs) == 5  # unchanged outputs compared on arrival, not written again
    assert path.stat().st_size < sum(b.nbytes for b in m.blobs.values()) + (512 << 10)
    assert _temporaries(tmp_path) == []


@pytest.mark.gpu
def test_gpu_unchanged_output_compare_finds_a_late_difference(tmp_path, monkeypatch) -> None:
    from kdump.bundle import attach_outputs, input_tensors, staging
    from kdump.bundle.writer import open_spool

    monkeypatch.setattr(staging, "STAGE_CHUNK", 1 << 20)
    x = torch.randn(3 << 20, device="cuda")  # 12 MiB: twelve chunks
    before = x.cpu()
    path = tmp_path / "late.kdump"
    sink = open_spool(path)
    call = capture_call("m:f", [x], sink=sink)
    x[-1] += 1  # only the last chunk differs
    attach_outputs(call, input_tensors(call, [x], {}), [0], sink=sink)
    save_calls(path, [call], spool=sink)
    loaded = load_bundle(path).calls[0]
    assert torch.equal(loaded.materialize("cpu").tensors[0], before)
    assert torch.equal(loaded.materialize_outputs("cpu")[0], x.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [True, False], ids=["device-copies", "over-budget"])
def test_gpu_watched_outputs_are_compared_with_device_copies(tmp_path, monkeypatch, on_device):
    """Outputs named before the call get a device copy of their spans (when the free device
    memory allows it) and are compared with it on the device after the call: an unchanged one
    shares its input's blob, a change in the last byte is found, the copies are freed after."""
    from kdump.bundle import attach_outputs, capture, input_tensors
    from kdump.bundle.writer import open_spool

    if not on_device:  # no free memory share: the comparison goes through the host
        monkeypatch.setattr(capture, "DEVICE_COPY_SHARE", 1 << 62)
    same = torch.randn(1 << 20, device="cuda")
    moved = torch.randint(0, 255, (5 << 20,), dtype=torch.uint8, device="cuda")
    before = [same.cpu(), moved.cpu()]
    path = tmp_path / "watched.kdump"
    sink = open_spool(path)
    call = capture_call("m:f", [same, moved], sink=sink, watch=[0, 1])
    assert sorted(call.inputs.device_copies) == ([0, 1] if on_device else [])
    moved[-1] += 1  # only the last byte differs
    attach_outputs(call, input_tensors(call, [same, moved], {}), [0, 1], sink=sink)
    assert call.inputs.device_copies == {}
    save_calls(path, [call], spool=sink)
    loaded = load_bundle(path)
    got = loaded.calls[0]
    assert torch.equal(got.materialize("cpu").tensors[0], before[0])
    assert torch.equal(got.materialize("cpu").tensors[1], before[1])
    outs = got.materialize_outputs("cpu")
    assert torch.equal(outs[0], before[0]) and torch.equal(outs[1], moved.cpu())
    assert len(loaded.manifest.blobs) == 3  # the unchanged output shares its input's blob


@pytest.mark.gpu
def test_gpu_sync_recording_stages_large_spans_into_the_store(tmp_path) -> None:
    import sys
    import types

    import kdump

    mod = types.ModuleType("kdump_io_gpu_target")

    def step(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> None:
        torch.matmul(x, w, out=out)

    step.__module__, step.__qualname__ = mod.__name__, "step"
    mod.step = step  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    w = torch.randn(2048, 2048, device="cuda")  # 16 MiB, the same in every call
    befores = []
    try:
        with kdump.recording(f"{mod.__name__}:step", out=tmp_path) as rec:
            for i in range(2):
                x = torch.full((64, 2048), float(i + 1), device="cuda")
                out = torch.zeros(64, 2048, device="cuda")
                befores.append((x.cpu(), out.cpu()))
                mod.step(w, x, out)
                befores[-1] += (out.cpu(),)
    finally:
        del sys.modules[mod.__name__]
    assert len(rec.written) == 2
    stored = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size == w.numel() * 4 for p in stored) == 1  # the weight once
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    for path, (x0, out0, out1) in zip(rec.written, befores):
        call = load_bundle(path).calls[0]
        assert torch.equal(call.args[0], w.cpu()) and torch.equal(call.args[1], x0)
        assert torch.equal(call.args[2], out0)
        assert torch.equal(call.materialize_outputs("cpu")[2], out1)
