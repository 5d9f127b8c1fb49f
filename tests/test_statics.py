"""Static operands in ring mode (kdump.record.flight.statics) on CPU: copied once per (storage,
version), statistics at record time, salvage into shared blobs or by-reference storages, damage
detection, lazy conj / neg views recorded as the kernel saw them; the MoE example on a GPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.format.records import Source
from kdump.record.config import RingConfig
from kdump.record.flight.statics import (
    ENTRY_BYTES,
    decode_stats,
    region_path,
    resolve_lazy,
    value_stats,
)
from kdump.record.flight.statics_reader import read_region

T = __name__
ROOT = Path(__file__).resolve().parents[1]
W_SHAPE = (256, 256)  # 256 KiB of float32: over the slot's room, so only the region can hold it


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x @ w)


def take(z: torch.Tensor) -> torch.Tensor:
    return z.abs()


def _ring(
    tmp_path: Path, slots: int = 8, static_bytes: int = 1 << 30, journal_dir: Path | None = None
) -> RingConfig:
    return RingConfig(
        slots=slots,
        slot_bytes=256 << 10,
        journal_dir=journal_dir or tmp_path / "shm",
        static_bytes=static_bytes,
    )


@pytest.fixture
def shm_dir(tmp_path: Path):
    """A journal folder in shared memory, as the recorder's default: CUDA pins file-backed
    memory only there (a disk-backed tmp_path is refused)."""
    import shutil
    import tempfile

    if not Path("/dev/shm").is_dir():
        yield tmp_path / "shm"
        return
    d = Path(tempfile.mkdtemp(prefix="kdump-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(tmp_path: Path, calls, ring: RingConfig, target: str = "linear"):
    """Record `calls()` in ring mode, flush; (written bundles, region read before the close)."""
    with kdump.recording(f"{T}:{target}", out=tmp_path / "out", mode="ring", ring=ring) as rec:
        fed = calls()
        r = rec.recorder
        region = read_region(r.journal.path) if r.journal is not None else None
        entries = list(region.entries) if region is not None else []
        if region is not None:
            region.close()
        rec.flush()
        written = list(rec.written)
    return written, entries, fed


def _by_call(paths):
    out = {}
    for p in paths:
        b = load_bundle(p)
        out[b.calls[-1].meta["journal"]["call_index"]] = b
    return out


def test_weight_used_by_100_calls_is_copied_once_and_every_bundle_holds_it(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*W_SHAPE, generator=g)

    def calls():
        xs = []
        for _ in range(100):
            x = torch.randn(4, W_SHAPE[0], generator=g)
            linear(x, w, torch.empty(4, W_SHAPE[1]))
            xs.append(x)
        return xs

    written, entries, xs = _run(tmp_path, calls, _ring(tmp_path))
    assert len(entries) == 1 and entries[0].copied  # one copy for 99 calls that saw it unchanged
    assert entries[0].nbytes == w.numel() * 4
    assert len(written) == 8
    for idx, b in _by_call(written).items():
        call = b.calls[0]
        b.verify()
        assert not call.synthesized
        assert torch.equal(call.args[1], w) and torch.equal(call.args[0], xs[idx])
        assert call.meta["journal"]["statics"] == [{"storage": 1, "source": "blob", "why": ""}]
    # content-addressed in the folder's store: one file of the weight's size for all 8 bundles
    blobs = [p for p in (written[0].parent / "blobs").rglob("*") if p.is_file()]
    assert sum(p.stat().st_size == w.numel() * 4 for p in blobs) == 1


def test_salvage_hashes_and_checks_a_shared_weight_once(tmp_path, monkeypatch):
    """Every bundle of a flush names the same weight: its bytes are copied and hashed once per
    salvage, and its store file is read back once (a flush of 64 calls sharing 134 MB of weights
    took 20 s when each bundle did all three)."""
    from kdump.bundle import store

    g = torch.Generator().manual_seed(0)
    w = torch.randn(*W_SHAPE, generator=g)
    hashed: list[int] = []
    real = store.blob_digests

    def counting(data):
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(store, "blob_digests", counting)

    def calls():
        for _ in range(20):
            linear(torch.randn(4, W_SHAPE[0], generator=g), w, torch.empty(4, W_SHAPE[1]))

    ring = _ring(tmp_path)
    with kdump.recording(f"{T}:linear", out=tmp_path / "out", mode="ring", ring=ring) as rec:
        calls()
    written = list(rec.written)  # leaving the recording salvaged the journal once
    assert len(written) == 8
    assert hashed.count(w.numel() * 4) == 1
    for b in _by_call(written).values():
        b.verify()  # a fresh reader checks everything, the weight's store file included
        assert torch.equal(b.calls[0].args[1], w)


def test_version_bump_recopies_and_each_bundle_sees_its_version(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(*W_SHAPE, generator=g)
    seen = []

    def calls():
        for i in range(8):
            if i == 4:
                w.add_(1.0)  # an in-place update: a new version of the same storage
            linear(torch.randn(2, W_SHAPE[0], generator=g), w, torch.empty(2, W_SHAPE[1]))
            seen.append(w.clone())

    written, entries, _ = _run(tmp_path, calls, _ring(tmp_path, slots=16))
    assert len(entries) == 2 and all(e.copied for e in entries)
    assert entries[0].version != entries[1].version
    got = _by_call(written)
    for idx in (1, 2, 3, 5, 6, 7):  # the 2nd sighting of each version on
        assert torch.equal(got[idx].calls[0].args[1], seen[idx]), idx
    # first sightings were not static yet: the slot lacked room, so their weight is missing
    for idx in (0, 4):
        assert got[idx].calls[0].synthesized == [got[idx].calls[0].tensor_names[1]]


def test_over_budget_is_by_reference_with_torch_statistics(tmp_path):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(*W_SHAPE, generator=g) * 3 + 0.5

    def calls():
        for _ in range(3):
            linear(torch.randn(2, W_SHAPE[0], generator=g), w, torch.empty(2, W_SHAPE[1]))

    written, entries, _ = _run(tmp_path, calls, _ring(tmp_path, static_bytes=4096))
    assert len(entries) == 1 and not entries[0].copied
    b = _by_call(written)[2]
    call = b.calls[0]
    st = call.storages[1]
    assert st.source is Source.BY_REFERENCE and st.stats is not None
    s = st.stats
    assert s.dtype == "float32"
    assert s.min == pytest.approx(float(w.min())) and s.max == pytest.approx(float(w.max()))
    assert s.mean == pytest.approx(float(w.double().mean()), abs=1e-9)
    assert s.std == pytest.approx(float(w.double().std()), rel=1e-9)
    assert s.checksum.startswith("crc32:")
    assert call.meta["journal"]["by_reference_tensors"] == [1]
    assert call.meta["journal"]["statics"][0]["why"] == "over the static region's budget"
    assert call.synthesized == [call.tensor_names[1]]
    again = call.materialize("cpu").tensors[1]
    assert again.shape == w.shape and float(again.std()) > 2  # re-created from the statistics


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8]
)
def test_statistics_match_torch_on_decoded_values(dtype):
    g = torch.Generator().manual_seed(3)
    v = torch.randn(5000, generator=g) * 4
    x = v.round().clamp(0, 255).to(dtype) if dtype == torch.uint8 else v.to(dtype)
    ref = x.double()
    s = decode_stats("x", value_stats(x).tolist())
    assert s.min == float(ref.min()) and s.max == float(ref.max())
    assert s.mean == pytest.approx(float(ref.mean()), abs=1e-9)
    assert s.std == pytest.approx(float(ref.std()), rel=1e-9)


def test_statistics_skip_non_finite_and_see_lazy_bits():
    x = torch.tensor([1.0, float("nan"), 3.0, float("inf"), -2.0])
    s = decode_stats("float32", value_stats(x).tolist())
    assert (s.min, s.max) == (-2.0, 3.0) and s.mean == pytest.approx(2 / 3)
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    seen = torch.view_as_real(z.conj().resolve_conj()).double()
    raw = decode_stats("float32", value_stats(z, conj=True).tolist())
    assert raw.mean == pytest.approx(float(seen.mean())) and raw.min == float(seen.min())
    neg = decode_stats("float32", value_stats(x[[0, 2]], neg=True).tolist())
    assert (neg.min, neg.max) == (-3.0, -1.0)
    assert decode_stats("float32", [0, 0, 0, math.inf, -math.inf]).std == 0.0


def test_torn_static_copy_is_detected_at_salvage(tmp_path):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(*W_SHAPE, generator=g)
    ring = _ring(tmp_path)
    with kdump.recording(f"{T}:linear", out=tmp_path / "out", mode="ring", ring=ring) as rec:
        for _ in range(3):
            linear(torch.randn(2, W_SHAPE[0], generator=g), w, torch.empty(2, W_SHAPE[1]))
        path = region_path(rec.recorder.journal.path)
        region = read_region(rec.recorder.journal.path)
        (e,) = region.entries
        region.close()
        with open(path, "r+b") as f:  # a stray write into the copied weight
            f.seek(e.offset + 100)
            f.write(b"\xde\xad")
        rec.flush()
        written = list(rec.written)
    call = _by_call(written)[2].calls[0]
    st = call.storages[1]
    assert st.source is Source.BY_REFERENCE
    assert st.stats is not None and st.stats.max == pytest.approx(float(w.max()))
    assert call.meta["journal"]["statics"][0]["why"] == "static copy is torn (checksum mismatch)"


def test_overwritten_static_entry_is_detected(tmp_path):
    """A region with room for one copy: the weight's next version re-uses its entry, so slots of
    the old version read by reference, never with the new bytes."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(*W_SHAPE, generator=g)
    old = w.clone()

    def calls():
        for i in range(6):
            if i == 3:
                w.mul_(2.0)
            linear(torch.randn(2, W_SHAPE[0], generator=g), w, torch.empty(2, W_SHAPE[1]))

    written, entries, _ = _run(tmp_path, calls, _ring(tmp_path, static_bytes=w.numel() * 4))
    assert len(entries) == 1 and entries[0].copied  # the same entry, holding the new version
    got = _by_call(written)
    assert torch.equal(got[5].calls[0].args[1], w)
    for idx in (1, 2):
        call = got[idx].calls[0]
        assert call.synthesized == [call.tensor_names[1]]
        why = call.meta["journal"]["statics"][0]["why"]
        assert why == "static entry was overwritten by a later version"
        assert not torch.equal(call.args[1], old)


def test_static_first_seen_during_capture_is_by_reference_then_filled(tmp_path, monkeypatch):
    from kdump.record.flight.recorder import RingRecorder

    g = torch.Generator().manual_seed(6)
    w = torch.randn(*W_SHAPE, generator=g)
    capturing = [False]
    monkeypatch.setattr(RingRecorder, "_is_capturing", staticmethod(lambda cuda: capturing[0]))
    ring = _ring(tmp_path)
    x = torch.randn(2, W_SHAPE[0], generator=g)
    out = torch.empty(2, W_SHAPE[1])
    with kdump.recording(f"{T}:linear", out=tmp_path / "o", mode="ring", ring=ring) as rec:
        linear(x, w, out)  # first sighting
        capturing[0] = True
        linear(x, w, out)  # seen unchanged, but no copy may start during capture
        capturing[0] = False
        rec.flush()
        site = [p for p in rec.written if load_bundle(p).calls[-1].meta["journal"].get("graph")]
        call = load_bundle(site[0]).calls[-1]
        why = call.meta["journal"]["statics"][0]
        assert why == {
            "storage": 1,
            "source": "by-reference",
            "why": "first seen during stream capture: not copied",
        }
        linear(x, w, out)  # eager again: copied now, same version
        rec.flush()
        site = [p for p in rec.written if load_bundle(p).calls[-1].meta["journal"].get("graph")]
        call = load_bundle(site[0]).calls[-1]
        assert not call.synthesized and torch.equal(call.args[1], w)


def test_spec_weight_is_static_from_its_first_call_and_inputs_never_are(tmp_path, monkeypatch):
    """A spec's weight role: copied at the first call; an input that does not change stays in
    the slots (only a spec's weights are static for a target with a spec)."""
    from kdump.kernels import registry
    from kdump.kernels.plugin import KernelSpec, Param, Role

    class Spec(KernelSpec):
        params = (Param("x", Role.INPUT), Param("w", Role.WEIGHT), Param("out", Role.OUTPUT))

    real = registry.spec_for
    monkeypatch.setattr(
        registry, "spec_for", lambda t, n=None, s=None: Spec() if T in t else real(t, n, s)
    )
    g = torch.Generator().manual_seed(7)
    w = torch.randn(*W_SHAPE, generator=g)
    x = torch.randn(128, W_SHAPE[0], generator=g)  # 128 KiB, the same at every call

    def calls():
        for _ in range(3):
            linear(x, w, torch.empty(128, W_SHAPE[1]))

    written, entries, _ = _run(tmp_path, calls, _ring(tmp_path))
    assert len(entries) == 1 and entries[0].nbytes == w.numel() * 4
    for b in _by_call(written).values():
        call = b.calls[0]
        assert torch.equal(call.args[1], w) and torch.equal(call.args[0], x)
        assert [s["storage"] for s in call.meta["journal"]["statics"]] == [1]


def test_static_region_off_with_zero_budget(tmp_path):
    g = torch.Generator().manual_seed(8)
    w = torch.randn(*W_SHAPE, generator=g)

    def calls():
        for _ in range(3):
            linear(torch.randn(2, W_SHAPE[0], generator=g), w, torch.empty(2, W_SHAPE[1]))

    written, entries, _ = _run(tmp_path, calls, _ring(tmp_path, static_bytes=0))
    assert entries == [] and not list((tmp_path / "shm").glob("*.static"))
    call = load_bundle(written[0]).calls[0]
    assert call.synthesized == [call.tensor_names[1]] and "statics" not in call.meta["journal"]


def test_static_budget_from_environment():
    assert RingConfig.from_env({"KDUMP_STATIC_BYTES": "256M"}).static_bytes == 256 << 20
    assert RingConfig.from_env({}).static_bytes == 1 << 30
    assert RingConfig.from_env({"KDUMP_STATIC_BYTES": "0"}).static_bytes == 0


def test_conj_and_neg_views_are_recorded_as_the_kernel_saw_them(tmp_path):
    g = torch.Generator().manual_seed(9)
    z = torch.randn(64, generator=g, dtype=torch.complex64)
    big = torch.randn(W_SHAPE[0] * 64, generator=g, dtype=torch.complex64)  # 128 KiB: static
    x = torch.randn(64, generator=g)
    views = [z.conj(), torch._neg_view(x), torch._neg_view(z.conj())]

    def calls():
        for v in views:
            take(v)
        for _ in range(3):
            take(big.conj())
        return views

    written, entries, _ = _run(tmp_path, calls, _ring(tmp_path), target="take")
    got = _by_call(written)
    assert len(entries) == 1  # the big conj view went through the static region
    for idx, v in enumerate(views):
        arg = got[idx].calls[0].args[0]
        assert not arg.is_conj() and not arg.is_neg()
        assert torch.equal(arg, v.resolve_conj().resolve_neg()), idx
    for idx in (4, 5):
        arg = got[idx].calls[0].args[0]
        assert torch.equal(arg, big.conj().resolve_conj()), idx


def test_device_fill_protocol_on_host_memory(tmp_path, monkeypatch):
    """The device path's markers and statistics (queued copies; on CPU they run at once): salvage
    takes the bytes on the markers alone (no CRC), the statistics by their own marker, and an
    entry whose `post` marker was never written reads as in flight."""
    from kdump.record.flight.statics import Statics

    monkeypatch.setattr(Statics, "_fill_for", lambda self, t: self._device_fill)
    monkeypatch.setattr(Statics, "_register", lambda self: True)
    g = torch.Generator().manual_seed(10)
    w = torch.randn(*W_SHAPE, generator=g).to(torch.bfloat16)

    def calls():
        for _ in range(3):
            linear(torch.randn(2, W_SHAPE[0], generator=g).bfloat16(), w, torch.empty(2, 256))

    written, entries, _ = _run(tmp_path, calls, _ring(tmp_path, slots=4))
    (e,) = entries
    assert e.copied and not e.flags & 2 and e.stats is not None  # no host CRC: markers only
    s = decode_stats(e.dtype, e.stats)
    assert e.dtype == "bfloat16" and s.max == float(w.max()) and s.min == float(w.min())
    assert all(torch.equal(b.calls[0].args[1], w) for b in map(load_bundle, written))

    ring = _ring(tmp_path / "2", slots=4)
    with kdump.recording(f"{T}:linear", out=tmp_path / "o2", mode="ring", ring=ring) as rec:
        calls()
        path = region_path(rec.recorder.journal.path)
        at = 4096 + e.index * ENTRY_BYTES + 88  # the post marker: as if the copy never finished
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(bytes(8))
        rec.flush()
        written = list(rec.written)
    call = load_bundle(written[0]).calls[0]
    assert call.meta["journal"]["statics"][0]["why"] == "static copy was in flight"
    assert call.storages[1].source is Source.BY_REFERENCE
    assert call.storages[1].stats.max == float(w.max()) and call.storages[1].stats.checksum == ""


def test_resolve_lazy_leaves_partial_elements_alone():
    raw = torch.arange(12, dtype=torch.uint8)
    same = resolve_lazy(raw.clone(), {"dtype": "complex64", "conj": True, "neg": False})
    assert torch.equal(same, raw)  # 12 bytes: no whole complex64 elements
    assert ENTRY_BYTES % 8 == 0


CHILD = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_statics import linear
g = torch.Generator().manual_seed(12)
w = torch.randn(256, 256, generator=g)
torch.save(w, sys.argv[1])
for _ in range(5):
    linear(torch.randn(2, 256, generator=g), w, torch.empty(2, 256))
os.abort()
"""


def test_weight_salvaged_from_the_static_region_after_abort(tmp_path):
    """Under `kdump record`: the process dies, the launcher salvages the journal and its static
    region (and says nothing about the region file), then removes both."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(Path(__file__).parent)))
    cmd = [sys.executable, "-m", "kdump", "record", "-t", f"{T}:linear", "-o", str(tmp_path / "o")]
    cmd += ["--ring-slots", "8", "--slot-bytes", "256K", "--"]
    cmd += [sys.executable, str(script), str(tmp_path / "w.pt")]
    env = dict(os.environ, KDUMP_JOURNAL_DIR=str(tmp_path / "shm"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 128 + 6, r.stderr
    assert "cannot salvage" not in r.stderr
    w = torch.load(tmp_path / "w.pt")
    bundles = _by_call(sorted((tmp_path / "o").rglob("*.kdump")))
    assert sorted(bundles) == [0, 1, 2, 3, 4]
    for idx, b in bundles.items():
        b.verify()
        assert torch.equal(b.calls[0].args[1], w) != (idx == 0), idx  # 0: its first sighting
    assert not list((tmp_path / "shm").glob("**/kdump-journal-*"))


# ---------------------------------------------------------------------------------------------
# GPU: the pinned region and device-side statistics; the MoE example under `kdump record`


def mix(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x @ w + v[: x.shape[0], : w.shape[1]].float())


@pytest.mark.gpu
def test_cuda_static_copy_in_pinned_region_and_device_statistics(tmp_path, shm_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(11)
    w = torch.randn(*W_SHAPE, device="cuda", generator=g)
    v = (torch.randn(512, 512, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    x = torch.randn(4, W_SHAPE[0], device="cuda", generator=g)
    out = torch.empty(4, W_SHAPE[1], device="cuda")
    # room for w; v keeps its statistics
    ring = _ring(tmp_path, static_bytes=w.numel() * 4, journal_dir=shm_dir)
    with kdump.recording(f"{T}:mix", out=tmp_path / "out", mode="ring", ring=ring) as rec:
        for _ in range(3):
            mix(x, w, v, out)
        assert rec.recorder.statics._registered  # pinned for the asynchronous copies
        torch.cuda.synchronize()
        rec.flush()
        written = list(rec.written)
    call = _by_call(written)[2].calls[0]
    assert torch.equal(call.args[1], w.cpu())
    st = call.storages[2]
    assert st.source is Source.BY_REFERENCE and st.stats.dtype == "float8_e4m3fn"
    ref = v.double()
    assert st.stats.min == float(ref.min()) and st.stats.max == float(ref.max())
    assert st.stats.mean == pytest.approx(float(ref.mean()), abs=1e-9)
    assert st.stats.std == pytest.approx(float(ref.std()), rel=1e-9)


@pytest.mark.gpu
def test_moe_decode_weights_held_once_and_replay_clean_on_reference(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = "kdump.kernels.sm120.api:m_grouped_fp8_gemm_nt_contiguous"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kdump", "record", "-t", target, "-o", str(out), "--"]
    cmd += [sys.executable, str(ROOT / "examples" / "moe_decode.py"), "--steps", "6"]
    r = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout + r.stderr
    bundles = sorted(out.rglob("journal-*.kdump"))
    assert bundles, r.stderr
    # w13 (8 x 512 x 512 fp8) and w2 (8 x 512 x 256 fp8): one file each in the shared store
    sizes = [p.stat().st_size for p in out.rglob("blobs/*/*")]
    assert sizes.count(8 * 512 * 512) == 1 and sizes.count(8 * 512 * 256) == 1, sizes
    replays = []
    for p in bundles:
        with load_bundle(p) as b:
            b.verify()
            for call in b.calls:  # tensors: a, sfa, b (the weight), sfb, d, grouped_layout
                assert call.tensor_names[2] not in call.synthesized  # the weight is held
                weight = call.tensors[2].storage
                st = [s for s in call.meta["journal"].get("statics", []) if s["storage"] == weight]
                assert st and st[0]["source"] == "blob", call.meta["journal"]
            if "graph_replay" in b.info:
                replays.append(p)
    assert replays
    rep = subprocess.run(
        [
            sys.executable,
            "-m",
            "kdump",
            "replay",
            str(replays[0]),
            "--backend",
            "reference",
            "--mode",
            "eager",
        ],
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert rep.returncode == 0, rep.stdout + rep.stderr
