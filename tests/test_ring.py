"""The flight recorder (mode ring) on CPU: host-memory journal, graph-site logic, salvage at exit
through the launcher, flush-signal forwarding, redaction."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kdump
from kdump import config
from kdump.bundle import load_bundle
from kdump.format.journal import SlotState
from kdump.record.config import RingConfig
from kdump.record.flight.journal_reader import read_journal
from kdump.record.flight.sites import CaptureTracker

T = __name__


def gemm_like(a: torch.Tensor, layout: torch.Tensor, out: torch.Tensor, scale: float = 1.0):
    out.copy_(a[: out.shape[0]] * scale + layout[: out.shape[0], None])


def crasher(a: torch.Tensor) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in)")


def _ring(tmp_path: Path, slots: int = 8) -> RingConfig:
    return RingConfig(slots=slots, slot_bytes=256 << 10, journal_dir=tmp_path / "shm")


def test_ring_records_last_calls_and_flush_writes_bundles(tmp_path):
    g = torch.Generator(device="cpu").manual_seed(1)
    fed = []
    with kdump.recording(
        f"{T}:gemm_like", out=tmp_path / "out", mode="ring", ring=_ring(tmp_path)
    ) as rec:
        for _ in range(11):
            a = torch.randn(16, 8, generator=g, device="cpu")
            layout = torch.randint(-1, 4, (16,), generator=g, device="cpu").float()
            out = torch.empty(16, 8, device="cpu")
            gemm_like(a, layout, out, scale=0.5)
            fed.append((a.clone(), layout.clone()))
        journal = rec.recorder.journal.path
        got = read_journal(journal)
        done = got.having(SlotState.COMPLETE)
        assert len(done) == 8  # the ring keeps the last 8 of 11
        assert [s.meta.call_index for s in done] == list(range(10, 2, -1))
        assert all(s.finished for s in done)
        rec.flush()
        written = rec.written
    assert len(written) == 8
    assert not journal.exists()  # a live session's close removes its journal
    with load_bundle(written[0]) as b:
        call = b.calls[0]
        assert call.meta["journal"]["call_index"] == 10
        a, layout = call.args[0], call.args[1]
        assert torch.equal(a, fed[10][0]) and torch.equal(layout, fed[10][1])


def test_ring_output_not_copied_and_disabled_torch_function(tmp_path):
    seen = []

    class Spy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    a = torch.randn(4, 4, device="cpu").as_subclass(Spy)
    layout = torch.arange(4, device="cpu").float()
    out = torch.zeros(4, 4, device="cpu")
    with kdump.recording(
        f"{T}:gemm_like", out=tmp_path / "o", mode="ring", ring=_ring(tmp_path)
    ) as rec:
        seen.clear()
        j = rec.recorder
        st = next(s for s in rec.patches.states if s.id.endswith("gemm_like"))
        after = j._before(st, 0, "gemm_like", (a, layout, out), {})
        after()
        assert seen == []  # the recorder's own tensor ops are invisible to the subclass
        slot = read_journal(j.journal.path).having(SlotState.COMPLETE)[0]
        assert slot.payloads[0] is not None and slot.payloads[1] is not None


def test_capture_sites_numbered_per_capture():
    tr = CaptureTracker()
    assert tr.next_site(False) is None
    assert tr.next_site(True) == (1, 0)
    assert tr.next_site(True) == (1, 1)
    assert tr.next_site(False) is None
    assert tr.next_site(True) == (2, 0)
    tr.begin()
    assert tr.next_site(True) == (3, 0)


def test_pinned_site_slot_survives_rotation(tmp_path):
    from kdump.format.journal import SlotMeta
    from kdump.record.flight.journal import Journal

    j = Journal.create(tmp_path, slots=4, slot_bytes=4096)
    pinned = j.pin_next()
    assert pinned == 0
    site = j.reserve(SlotMeta(call_index=99, target="t"), index=pinned)
    site.commit()
    for i in range(10):
        j.record(SlotMeta(call_index=i, target="t"), [])
    got = read_journal(j.path)
    idx = {s.meta.call_index: s.index for s in got.having(SlotState.COMPLETE)}
    assert idx[99] == 0 and set(idx) == {99, 9, 8, 7}
    assert j.pin_next() in (1, 2, 3) and j.pin_next() is None  # at most half the ring pinned
    j.unlink()


def test_device_marker_states(tmp_path):
    """Slots whose payloads device copies write: markers decide in flight / done."""
    from kdump.format.journal import SlotMeta
    from kdump.record.flight.journal import Journal

    j = Journal.create(tmp_path, slots=4, slot_bytes=4096)
    meta = SlotMeta(call_index=1, target="t", storages=[{"span_nbytes": 8}])
    s = j.reserve(meta)
    s.commit(device=True)
    assert read_journal(j.path).slots[0].state is SlotState.IN_FLIGHT  # nothing copied yet
    s.marker("pre")[:] = (3).to_bytes(8, "little")
    s.payload(0)[:] = b"abcdefgh"
    assert read_journal(j.path).slots[0].state is SlotState.IN_FLIGHT  # being written
    s.marker("post")[:] = (3).to_bytes(8, "little")
    r = read_journal(j.path).slots[0]
    assert r.state is SlotState.COMPLETE and not r.finished and r.token == 3
    assert r.payloads[0] == b"abcdefgh"
    s.marker("done")[:] = (3).to_bytes(8, "little")
    assert read_journal(j.path).slots[0].finished
    s.marker("done")[:] = (4).to_bytes(8, "little")
    assert read_journal(j.path).slots[0].state is SlotState.TORN
    j.unlink()


def test_redaction_patterns():
    argv = ["serve", "--api-key=s3cr3t", "--token", "abc", "--db=postgres://u:pw@h/d", "-n", "3"]
    got = config.redact_argv(argv)
    assert "s3cr3t" not in " ".join(got) and "abc" not in got and "pw" not in " ".join(got)
    assert got[0] == "serve" and got[-2:] == ["-n", "3"]
    env = {"SGLANG_DB": "mysql://root:hunter2@db:3306/x", "KDUMP_OUT": "/tmp/o"}
    rec = config.recorded_environment(env)
    assert "hunter2" not in rec["SGLANG_DB"] and rec["KDUMP_OUT"] == "/tmp/o"


# ---------------------------------------------------------------------------------------------
# Through the launcher

CHILD = """
import os, sys, time, torch
sys.path.insert(0, {tests!r})
from test_ring import gemm_like
how = sys.argv[1]
g = torch.Generator().manual_seed(5)
for step in range(int(sys.argv[2])):
    a = torch.randn(16, 8, generator=g)
    layout = torch.randint(-1, 4, (16,), generator=g).float()
    torch.save((a, layout), os.path.join(sys.argv[3], f"fed-{{step}}.pt"))
    gemm_like(a, layout, torch.empty(16, 8), scale=0.5)
    if how == "wait":
        print("ready", flush=True)
        time.sleep(0.002)
if how == "raise":
    raise RuntimeError("CUDA error: illegal memory access (stand-in)")
if how == "abort":
    os.abort()
if how == "flush":
    print("ready", flush=True)
    time.sleep(30)
"""


def _launch(tmp_path: Path, how: str, steps: int = 5, *opts: str, wait: bool = True):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(Path(__file__).parent)))
    fed = tmp_path / "fed"
    fed.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "kdump", "record", "-t", "test_ring:gemm_like"]
    cmd += ["-o", str(tmp_path / "out"), "--ring-slots", "8", "--slot-bytes", "256K", *opts]
    cmd += ["--", sys.executable, str(script), how, str(steps), str(fed)]
    env = dict(os.environ, KDUMP_JOURNAL_DIR=str(tmp_path / "shm"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


def _salvaged(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "out").rglob("*.kdump"))


@pytest.mark.parametrize("how,rc", [("exit", 0), ("raise", 1), ("abort", 128 + 6)])
def test_salvage_at_exit(tmp_path, how, rc):
    code, _, err = _launch(tmp_path, how)
    assert code == rc, err
    bundles = _salvaged(tmp_path)
    assert len(bundles) == 5, err
    newest = max(bundles, key=lambda p: load_bundle(p).calls[0].meta["journal"]["seq"])
    with load_bundle(newest) as b:
        call = b.calls[0]
        a, layout = torch.load(tmp_path / "fed" / "fed-4.pt")
        assert torch.equal(call.args[0], a) and torch.equal(call.args[1], layout)
        crash = call.meta["crash"]
        if how == "raise":
            assert "illegal memory access" in crash["traceback"]
            assert "illegal memory access" in crash["stderr_tail"]
            assert "cuda_error" in crash
        if how == "abort":
            assert crash["signal"] == 6
    assert not list((tmp_path / "shm").glob("**/kdump-journal-*"))  # shared memory removed
    assert "illegal memory" in err or how != "raise"  # the user still sees the child's stderr


def test_flush_signal_is_forwarded(tmp_path):
    p = _launch(tmp_path, "flush", 3, "--flush-signal", "USR1", wait=False)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    p.send_signal(signal.SIGUSR1)  # to kdump: it forwards to the program, which keeps running
    deadline = time.time() + 30
    while time.time() < deadline and len(_salvaged(tmp_path)) < 3:
        time.sleep(0.1)
    assert len(_salvaged(tmp_path)) == 3
    assert p.poll() is None  # the program was flushed, not killed
    p.terminate()
    p.communicate(timeout=60)


def _fed(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(1000 + step)
    a = torch.randn(16, 8, generator=g, device="cpu")
    return a, torch.randint(-1, 4, (16,), generator=g, device="cpu").float()


def _recorded_child(journals: Path, ready: int) -> None:
    """A forked child: record calls in ring mode until it is killed."""
    try:
        ring = RingConfig(slots=8, slot_bytes=64 << 10, journal_dir=journals)
        with kdump.recording(f"{T}:gemm_like", out=journals / "o", mode="ring", ring=ring):
            out = torch.empty(16, 8, device="cpu")
            for step in range(100000):
                a, layout = _fed(step)
                gemm_like(a, layout, out, scale=0.5)
                if step == 0:
                    os.write(ready, b"r")
    finally:
        os._exit(0)


def test_sigkill_campaign_never_corrupt(tmp_path):
    """SIGKILL a recording process at random moments (50 trials): salvage gives only bundles
    that load and verify, each holding exactly what its step fed."""
    from kdump.record.flight.salvage import salvage_journal

    rnd = random.Random(7)
    total = 0
    for trial in range(50):
        journals = tmp_path / f"t{trial}"
        journals.mkdir()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _recorded_child(journals, w)
        os.close(w)
        assert os.read(r, 1) == b"r"
        os.close(r)
        time.sleep(rnd.uniform(0, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        (journal,) = journals.glob("kdump-journal-*")
        res = salvage_journal(journal, journals / "salvaged")
        assert res.bundles, res.torn
        for b in res.bundles:
            with load_bundle(b) as bundle:
                bundle.verify()
                call = bundle.calls[0]
                a, layout = _fed(call.meta["journal"]["call_index"])
                assert torch.equal(call.args[0], a) and torch.equal(call.args[1], layout)
                total += 1
    assert total >= 50


def test_by_reference_and_missing_storages_materialise_from_stats(tmp_path):
    from dataclasses import replace

    from kdump.bundle import capture_call, save_calls
    from kdump.format.records import Source, Stats

    w = torch.randn(64, 32, device="cpu") * 3 + 1
    x = torch.randn(8, 32, device="cpu")
    call = capture_call("m:f", [w, x], {})
    st = call.inputs.storages
    stats = Stats("float32", float(w.min()), float(w.max()), float(w.mean()), float(w.std()))
    st[0] = replace(st[0], source=Source.BY_REFERENCE, stats=stats)
    st[1] = replace(st[1], source=Source.MISSING)
    path = save_calls(tmp_path / "b.kdump", [call])
    with load_bundle(path) as b:
        b.verify()
        c = b.calls[0]
        assert len(b.blobs) == 0  # neither storage's bytes are in the bundle
        assert c.synthesized == c.tensor_names[:2]
        got_w, got_x = c.materialize("cpu").tensors
        assert got_w.shape == w.shape and got_w.stride() == w.stride()
        assert stats.min <= float(got_w.min()) and float(got_w.max()) <= stats.max
        assert abs(float(got_w.mean()) - stats.mean) < 0.5 and float(got_w.std()) > 1
        assert not torch.equal(got_w, w)  # re-created, not recorded
        assert torch.count_nonzero(got_x) == 0  # missing without stats: zeros, said so above
        again = load_bundle(path).calls[0].materialize("cpu").tensors[0]
        assert torch.equal(again, got_w)  # seeded: every replay sees the same values


def test_capture_site_bundle_pairs_the_eager_call_before_capture(tmp_path, monkeypatch):
    """Graph logic with a fake capturing flag: the site's slot is pinned, the eager call on the
    same buffers before capture stays, and salvage writes both as one two-call bundle."""
    from kdump.record.flight.recorder import RingRecorder

    g = torch.Generator(device="cpu").manual_seed(3)
    a = torch.randn(16, 8, generator=g, device="cpu")
    layout = torch.randint(-1, 4, (16,), generator=g, device="cpu").float()
    out = torch.empty(16, 8, device="cpu")
    capturing = [False]
    monkeypatch.setattr(RingRecorder, "_is_capturing", staticmethod(lambda cuda: capturing[0]))
    ring = _ring(tmp_path, slots=6)
    with kdump.recording(f"{T}:gemm_like", out=tmp_path / "o", mode="ring", ring=ring) as rec:
        gemm_like(a, layout, out)  # warm-up: what the buffers hold at capture
        warm = (a.clone(), layout.clone())
        capturing[0] = True
        gemm_like(a, layout, out)  # the capture site
        capturing[0] = False
        a.copy_(torch.randn(16, 8, generator=g, device="cpu"))
        for _ in range(12):  # eager traffic rotates the ring
            gemm_like(torch.randn(4, 8, device="cpu"), layout.clone(), torch.empty(4, 8))
        r = rec.recorder
        assert len(r.sites) == 1 and r.journal.pinned == {0, 1}
        rec.flush()
        written = list(rec.written)
    pair = [p for p in written if len(load_bundle(p).calls) == 2]
    assert len(pair) == 1
    with load_bundle(pair[0]) as b:
        first, site = b.calls
        assert b.info["graph_replay"]["capture_call"] == 0
        assert site.meta["journal"]["graph"] == 1 and site.meta["journal"]["site"] == 0
        assert torch.equal(first.args[0], warm[0]) and torch.equal(first.args[1], warm[1])


def test_signature_cache_keeps_each_calls_values_and_scalars(tmp_path):
    """Repeated calls on the same buffers reuse the cached layout; each slot still holds its own
    bytes and scalars."""
    a = torch.zeros(16, 8)
    layout = torch.zeros(16)
    out = torch.empty(16, 8)
    scales = [2.0, 0.5, 0.5, 2.0, 3.0]
    with kdump.recording(
        f"{T}:gemm_like", out=tmp_path / "out", mode="ring", ring=_ring(tmp_path)
    ) as rec:
        for i, s in enumerate(scales):
            a.fill_(float(i))
            gemm_like(a, layout, out, scale=s)
        assert len(rec.recorder._layouts) == 3  # one layout per distinct scalar
        rec.flush()
        written = list(rec.written)
    seen = {}
    for p in written:
        with load_bundle(p) as b:
            call = b.calls[0]
            i = call.meta["call_index"]
            seen[i] = (float(call.args[0][0, 0]), call.kwargs["scale"])
    assert seen == {i: (float(i), s) for i, s in enumerate(scales)}


def test_close_with_capture_sites_keeps_the_journal_mapped(tmp_path, monkeypatch):
    """Captured graphs write into the journal at every replay, also after the recording ends:
    with capture sites, leaving the recording writes the bundles and removes the file but keeps
    the mapping for the life of the process."""
    from kdump.record.flight import recorder as ring_mod
    from kdump.record.flight.recorder import RingRecorder

    capturing = [False]
    monkeypatch.setattr(RingRecorder, "_is_capturing", staticmethod(lambda cuda: capturing[0]))
    a, layout, out = torch.randn(16, 8), torch.zeros(16), torch.empty(16, 8)
    kept = len(ring_mod._RETIRED)
    with kdump.recording(
        f"{T}:gemm_like", out=tmp_path / "o", mode="ring", ring=_ring(tmp_path)
    ) as rec:
        gemm_like(a, layout, out)
        capturing[0] = True
        gemm_like(a, layout, out)  # a capture site
        capturing[0] = False
        path = rec.recorder.journal.path
    assert rec.written and not path.exists()
    journal, _ = ring_mod._RETIRED[kept]
    assert journal.path == path and journal._fd >= 0  # still mapped
    journal.close()  # (the test's own clean-up; a real process keeps it until exit)
    del ring_mod._RETIRED[kept:]


def test_close_without_capture_sites_removes_the_journal(tmp_path):
    from kdump.record.flight import recorder as ring_mod

    kept = len(ring_mod._RETIRED)
    with kdump.recording(
        f"{T}:gemm_like", out=tmp_path / "o", mode="ring", ring=_ring(tmp_path)
    ) as rec:
        gemm_like(torch.randn(16, 8), torch.zeros(16), torch.empty(16, 8))
        path = rec.recorder.journal.path
    assert rec.written and not path.exists() and len(ring_mod._RETIRED) == kept


def test_a_second_flush_writes_only_what_changed(tmp_path, monkeypatch):
    """Flushes of a live process (the flush signal, then the exit) write a bundle again only when
    its slot changed: the unchanged ones stay as the first flush wrote them."""
    from kdump.record.flight import salvage as salvage_mod

    writes: list[str] = []
    real = salvage_mod._write_bundle

    def counting(path, *a, **k):
        writes.append(path.name)
        return real(path, *a, **k)

    monkeypatch.setattr(salvage_mod, "_write_bundle", counting)
    a, layout, out = torch.randn(16, 8), torch.zeros(16), torch.empty(16, 8)
    with kdump.recording(
        f"{T}:gemm_like", out=tmp_path / "o", mode="ring", ring=_ring(tmp_path)
    ) as rec:
        for _ in range(3):
            gemm_like(a, layout, out)
        rec.flush()
        first = sorted(rec.written)
        assert len(writes) == 3
        rec.flush()
        assert len(writes) == 3 and sorted(rec.written) == first  # nothing changed
        gemm_like(a, layout, out)
        rec.flush()
        assert len(writes) == 4 and len(rec.written) == 4  # only the new call
        first[0].unlink()  # a bundle someone removed is written again
        rec.flush()
        assert len(writes) == 5
    for p in rec.written:
        with load_bundle(p) as b:
            b.verify()
