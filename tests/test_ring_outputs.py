"""The flight recorder keeps outputs (CPU): copied after the call into the slot's room left
after the inputs, salvaged as the bundle's `outputs` in the sync recorder's format; `--outputs`
honoured; targets with a reference spec keep none by default; outputs that do not fit named in
`meta["outputs_not_kept"]`; journals of version 3 still read."""

from __future__ import annotations

import struct
import sys
import types
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.bundle.inspect import describe_call, outputs_line, recorded_outputs
from kdump.format.journal import MARKER_AT, TRAILER_BYTES, JournalError, SlotMeta, SlotState
from kdump.record.config import RingConfig
from kdump.record.flight.journal import Journal
from kdump.record.flight.journal_reader import read_journal

T = __name__


def double(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)


def all_but_last(x: torch.Tensor, out: torch.Tensor) -> None:
    out[:-1] = x[:-1] + 1  # the last row is left as it was


def raises_after_writing(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)
    raise ValueError("after writing")


def _ring(tmp_path: Path, slot_bytes: int = 64 << 10, slots: int = 8) -> RingConfig:
    return RingConfig(slots=slots, slot_bytes=slot_bytes, journal_dir=tmp_path / "shm")


def _record(tmp_path: Path, fn: Any, feeds: list[tuple[Any, ...]], **kw: Any) -> list[Path]:
    """Record `fn` over `feeds` with the flight recorder in this process; the bundles, oldest
    call first."""
    ring = kw.pop("ring", None) or _ring(tmp_path)
    with kdump.recording(
        f"{T}:{fn.__name__}", out=tmp_path / "out", mode="ring", ring=ring, **kw
    ) as rec:
        target = getattr(sys.modules[T], fn.__name__)
        for args in feeds:
            try:
                target(*args)
            except ValueError:
                pass
        rec.flush()
        written = list(rec.written)
    return sorted(written, key=lambda p: int(p.name.split("-seq")[1].split(".")[0]))


def test_generic_target_keeps_what_the_call_wrote(tmp_path):
    g = torch.Generator().manual_seed(3)
    out = torch.zeros(16, 8)
    feeds, expected = [], []
    for _ in range(3):
        x = torch.randn(16, 8, generator=g)
        feeds.append((x, out))
        expected.append(x * 2)
    paths = _record(tmp_path, double, feeds)
    assert len(paths) == 3
    for p, want in zip(paths, expected):
        with load_bundle(p) as b:
            call = b.calls[0]
            assert call.has_outputs
            # every tensor argument is kept after the call, as sync mode keeps them: out
            # (tensor 1) changed, x did not
            assert call.inplace == [(0, 0), (1, 1)]
            assert recorded_outputs(call) == ["x", "out"]
            assert torch.equal(call.outputs["out"], want)
            facts = call.meta["journal"]["outputs"]
            assert facts == {"kept": 2, "changed": 1, "unchanged": 1}
            assert "outputs_not_kept" not in call.meta
            assert "outputs" not in call.meta  # the slot's layout of them stays in the journal
    # the bytes before the call are the inputs: the previous call's result
    with load_bundle(paths[2]) as b:
        assert torch.equal(b.calls[0].kwargs.get("out", b.calls[0].args[1]), expected[1])


def test_partly_written_output_keeps_the_unwritten_row(tmp_path):
    x = torch.arange(12.0).reshape(4, 3)
    out = torch.full((4, 3), -7.0)
    (path,) = _record(tmp_path, all_but_last, [(x, out)])
    with load_bundle(path) as b:
        call = b.calls[0]
        got = call.outputs["out"]
        assert torch.equal(got[:-1], x[:-1] + 1)
        assert torch.equal(got[-1], torch.full((3,), -7.0))  # as it was before the call
        assert torch.equal(call.args[1], torch.full((4, 3), -7.0))  # the bytes before the call


def test_unchanged_output_of_a_repeat_is_kept_and_said_unchanged(tmp_path):
    """A call that writes the bytes its output held (a repeat, a stale result) keeps them: they
    are what production computed, the oracle a replay compares with."""
    x = torch.arange(8.0)
    out = torch.zeros(8)
    first, second = _record(tmp_path, double, [(x, out), (x, out)])
    with load_bundle(first) as b:
        assert b.calls[0].meta["journal"]["outputs"]["changed"] == 1
    with load_bundle(second) as b:
        call = b.calls[0]
        # the same values again: nothing changed, and its bytes before the call say so
        assert call.has_outputs and torch.equal(call.outputs["out"], x * 2)
        assert call.meta["journal"]["outputs"] == {"kept": 2, "changed": 0, "unchanged": 2}


def test_outputs_none_keeps_none(tmp_path):
    x, out = torch.arange(8.0), torch.zeros(8)
    (path,) = _record(tmp_path, double, [(x, out)], outputs="none")
    with load_bundle(path) as b:
        call = b.calls[0]
        assert not call.has_outputs and "outputs" not in call.meta["journal"]


def test_outputs_by_name_keeps_only_that_one(tmp_path):
    def both(x: torch.Tensor, out: torch.Tensor) -> None:
        x.add_(1)
        out.copy_(x)

    sys.modules[T].both = both  # type: ignore[attr-defined]
    try:
        x, out = torch.zeros(8), torch.zeros(8)
        (path,) = _record(tmp_path, both, [(x, out)], outputs="out")
    finally:
        del sys.modules[T].both  # type: ignore[attr-defined]
    with load_bundle(path) as b:
        call = b.calls[0]
        assert call.inplace == [(1, 0)] and torch.equal(call.outputs["out"], torch.ones(8))


def test_a_call_that_raised_keeps_no_outputs(tmp_path):
    x, out = torch.arange(8.0), torch.zeros(8)
    (path,) = _record(tmp_path, raises_after_writing, [(x, out)])
    with load_bundle(path) as b:
        call = b.calls[0]
        assert not call.has_outputs
        assert call.meta["journal"]["outputs"].startswith("not copied")


def test_output_over_the_slot_share_is_listed_not_kept(tmp_path):
    x = torch.zeros(8)
    out = torch.zeros(8192)  # 32 KiB: over what an 16 KiB slot keeps after x

    def spread(x: torch.Tensor, out: torch.Tensor) -> None:
        out.fill_(float(x.sum()) + 1)

    sys.modules[T].spread = spread  # type: ignore[attr-defined]
    try:
        (path,) = _record(tmp_path, spread, [(x, out)], ring=_ring(tmp_path, 16 << 10))
        with load_bundle(path) as b:
            call = b.calls[0]
            said = call.meta["outputs_not_kept"]
            assert said["tensors"] == ["out"] and said["bytes"] == 8192 * 4
            assert said["slot_bytes"] > 16 << 10
            assert call.inplace == [(0, 0)]  # x fits and is kept; out does not
            shown = describe_call(call)
            assert shown["outputs_not_kept"] == {
                "tensors": ["out"],
                "bytes": 8192 * 4,
                "slot_bytes": said["slot_bytes"],
            }
            assert outputs_line(shown) == (
                "outputs recorded: x; not kept (did not fit the flight "
                f"recorder's slot): out (32768 bytes); --slot-bytes {said['slot_bytes']} would "
                "hold them"
            )
        # the slot size it names keeps them
        out.zero_()
        (path,) = _record(tmp_path / "bigger", spread, [(x, out)],
                          ring=_ring(tmp_path / "bigger", said["slot_bytes"]))  # fmt: skip
        with load_bundle(path) as b:
            call = b.calls[0]
            assert "outputs_not_kept" not in call.meta
            assert torch.equal(call.outputs["out"], torch.ones(8192))
    finally:
        del sys.modules[T].spread  # type: ignore[attr-defined]


def _deep_gemm_like(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A module standing in for DeepGEMM's entry point (its spec has a reference); the call
    writes d."""

    def m_grouped_fp8_gemm_nt_contiguous(a: Any, b: Any, d: torch.Tensor, layout: Any) -> None:
        d.fill_(3)

    mod = types.ModuleType("deep_gemm")
    mod.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    return mod


def _dg_args() -> tuple[Any, ...]:
    m, n, k = 8, 16, 128
    a = (torch.zeros(m, k).to(torch.float8_e4m3fn), torch.ones(m, 1))
    b = (torch.zeros(1, n, k).to(torch.float8_e4m3fn), torch.ones(1, 1, 1))
    return a, b, torch.zeros(m, n, dtype=torch.bfloat16), torch.zeros(m, dtype=torch.int32)


@pytest.mark.parametrize("outputs", ["default", "d"])
def test_reference_spec_keeps_none_by_default(tmp_path, monkeypatch, outputs):
    _deep_gemm_like(monkeypatch)
    with kdump.recording(
        "deep_gemm:m_grouped_fp8_gemm_nt_contiguous",
        out=tmp_path / "out",
        mode="ring",
        ring=_ring(tmp_path),
        outputs=outputs,
    ) as rec:
        sys.modules["deep_gemm"].m_grouped_fp8_gemm_nt_contiguous(*_dg_args())
        slots = read_journal(rec.recorder.journal.path).having(SlotState.COMPLETE)
        assert [bool(s.meta.outputs) for s in slots] == [outputs != "default"]
        rec.flush()
        (path,) = rec.written
    with load_bundle(path) as b:
        call = b.calls[0]
        if outputs == "default":  # today's cost: nothing copied after the call
            assert not call.has_outputs and "outputs" not in call.meta["journal"]
        else:
            assert recorded_outputs(call) == ["d"]
            assert torch.equal(call.outputs["d"], torch.full((8, 16), 3, dtype=torch.bfloat16))


def test_slot_outputs_are_outside_the_checksum_and_marked(tmp_path):
    """Journal level: an output payload is written after `commit` (no checksum covers it); the
    `out` marker says whether it holds this call's bytes."""
    j = Journal.create(tmp_path, slots=2, slot_bytes=4096)
    meta = SlotMeta(
        call_index=0,
        target="t",
        storages=[{"span_nbytes": 8}],
        tensors=[{"storage": 0}],
        outputs=[{"storage": 0, "tensors": [0]}],
    )
    s = j.reserve(meta)
    s.payload(0)[:] = b"before.."
    s.commit()
    got = read_journal(j.path).slots[0]
    assert got.state is SlotState.COMPLETE and not got.outputs_held
    assert got.payloads == (b"before..",) and got.meta.outputs == [{"storage": 0, "tensors": [0]}]
    s.output(0)[:] = b"after..."
    assert not read_journal(j.path).slots[0].outputs_held  # copied, not marked yet
    s.mark_outputs(1)
    s.finish()
    got = read_journal(j.path).slots[0]
    assert got.state is SlotState.COMPLETE and got.outputs_held
    assert got.output_bytes == (b"after...",) and got.payloads == (b"before..",)
    # A later replay's marker (another token) is not this call's
    s.marker("out")[:] = (5).to_bytes(8, "little")
    assert not read_journal(j.path).slots[0].outputs_held
    j.unlink()


def test_out_marker_in_a_slot_without_outputs_reads_torn(tmp_path):
    j = Journal.create(tmp_path, slots=2, slot_bytes=4096)
    s = j.record(SlotMeta(call_index=0, target="t", storages=[{"span_nbytes": 4}]), [b"abcd"])
    s.marker("out")[:] = (1).to_bytes(8, "little")
    assert read_journal(j.path).slots[0].state is SlotState.TORN
    j.unlink()


def _as_version(path: Path, version: int) -> None:
    """Rewrite a journal's format version (and the header checksum over it)."""
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 8, version)
    hlen, plen = struct.unpack_from("<II", raw, 48)
    end = 56 + hlen + plen
    struct.pack_into("<I", raw, end, zlib.crc32(bytes(raw[:end])))
    path.write_bytes(bytes(raw))


def test_version_3_journal_still_reads(tmp_path):
    """A slot without outputs is laid out as version 3 wrote it: such a journal reads as one."""
    j = Journal.create(tmp_path, slots=2, slot_bytes=4096)
    j.record(SlotMeta(call_index=4, target="t", storages=[{"span_nbytes": 4}]), [b"wxyz"])
    j.close()
    _as_version(j.path, 3)
    got = read_journal(j.path)
    assert got.header.version == 3
    (slot,) = got.having(SlotState.COMPLETE)
    assert slot.payloads == (b"wxyz",) and slot.meta.call_index == 4 and not slot.meta.outputs
    _as_version(j.path, 2)
    with pytest.raises(JournalError, match="version 2 is not supported"):
        read_journal(j.path)


def test_version_3_slot_naming_outputs_reads_torn(tmp_path):
    j = Journal.create(tmp_path, slots=2, slot_bytes=4096)
    meta = SlotMeta(
        call_index=0,
        target="t",
        storages=[{"span_nbytes": 4}],
        tensors=[{"storage": 0}],
        outputs=[{"storage": 0, "tensors": [0]}],
    )
    j.record(meta, [b"abcd"])
    j.close()
    _as_version(j.path, 3)
    (slot,) = [s for s in read_journal(j.path).slots if s.state is not SlotState.EMPTY]
    assert slot.state is SlotState.TORN and "names outputs" in slot.reason


def test_trailer_out_marker_offset():
    assert MARKER_AT["out"] == 48 and TRAILER_BYTES == 64


def test_exact_repeats_keep_outputs_too(tmp_path):
    """The exact-repeat path (same buffers, new values) writes the outputs as the full path."""
    x, out = torch.zeros(4, 4), torch.zeros(4, 4)
    fed = []
    with kdump.recording(
        f"{T}:double", out=tmp_path / "out", mode="ring", ring=_ring(tmp_path)
    ) as rec:
        for i in range(6):
            x.copy_(torch.full((4, 4), float(i + 1)))
            fed.append(x * 2)
            sys.modules[T].double(x, out)
        assert rec.recorder.fast_calls >= 3
        rec.flush()
        paths = list(rec.written)
    assert len(paths) == 6
    for p in paths:
        with load_bundle(p) as b:
            call = b.calls[0]
            i = call.meta["journal"]["call_index"]
            assert call.inplace == [(0, 0), (1, 1)]
            assert torch.equal(call.outputs["out"], fed[i])


def test_bench_flight_outputs_column_runs_on_cpu(bench_import, tmp_path):
    """bench/bench_flight.py's outputs column (run on a GPU by hand): its generic target, the
    recording with and without outputs and the table row, here on CPU tensors (no graph step)."""
    flight = bench_import("bench_flight")
    rows = flight.generic_table(tmp_path, [4], 2, "cpu")
    assert rows[0] == flight.GENERIC_HEADER
    cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert len(cells) == rows[0].count("|") - 1 == 10
    assert cells[0] == "4 (1M)" and cells[1:6] == ["-"] * 5  # no graph step on the CPU
    assert flight.generic_slot_bytes(512 << 10) == 4 << 20  # both, before and after the call
    assert cells[-1] == "yes"  # the default kept the outputs of the newest call
    none = flight.generic_recorded(torch.ones(8), torch.zeros(8), tmp_path, "none", True, 2)
    assert none["held"] is False and none["host"] > 0 and "step" not in none


def test_info_shows_hostile_outputs_not_kept_escaped_and_bounded(tmp_path):
    from kdump.bundle import save_calls
    from kdump.bundle.capture import capture_call

    call = capture_call(f"{T}:double", (torch.zeros(2), torch.zeros(2)), {})
    call.meta["outputs_not_kept"] = {"tensors": ["\x1b[31mout", 5], "bytes": "9", "slot_bytes": -1}
    save_calls(tmp_path / "b.kdump", [call])
    with load_bundle(tmp_path / "b.kdump") as b:
        shown = describe_call(b.calls[0])
    assert shown["outputs_not_kept"] == {
        "tensors": ["\\x1b[31mout", "5"],
        "bytes": None,
        "slot_bytes": None,
    }
    assert outputs_line(shown).endswith("did not fit the flight recorder's slot): \\x1b[31mout, 5")
