"""Recording hygiene: lazy conj / neg views, `__torch_function__` subclasses, temporaries."""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.record.capture_dir import list_bundles


def _pair(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.real.sum() + y.sum()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg().contiguous().view(torch.uint8)


def test_conj_and_neg_views_record_the_values_the_kernel_saw(tmp_path) -> None:
    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.complex(
        torch.randn(5, 3, generator=g, device="cpu"), torch.randn(5, 3, generator=g, device="cpu")
    ).t()  # a transposed layout, non-zero imaginary parts
    y = torch.randn(4, 6, generator=g, device="cpu")[:, 1:5]
    xc, yn = x.conj(), y._neg_view()
    assert xc.is_conj() and yn.is_neg()
    raw_x = x.clone()
    kdump.dump_call(tmp_path / "one.kdump", _pair, xc, yn)
    assert xc.is_conj() and yn.is_neg() and torch.equal(x, raw_x)  # the arguments are untouched
    call = load_bundle(tmp_path / "one.kdump").calls[0]
    got_x, got_y = call.args
    assert not got_x.is_conj() and not got_y.is_neg()
    assert got_x.stride() == xc.stride() and got_y.stride() == yn.stride()
    assert torch.equal(_bits(got_x), _bits(x.conj().resolve_conj()))
    assert torch.equal(_bits(got_y), _bits(y._neg_view().resolve_neg()))
    assert not torch.equal(_bits(got_x), _bits(x))  # the stored values are not the raw storage


class Counting(torch.Tensor):
    """A `__torch_function__` subclass that counts every torch call it sees."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Counting.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


PROGRAM = """
def affine(x, out):
    out.copy_(x * 3.0 + 1.0)
    return out.sum()
"""


@pytest.fixture
def progmod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "hyg_prog.py").write_text(PROGRAM)
    monkeypatch.syspath_prepend(str(mod))
    sys.modules.pop("hyg_prog", None)
    yield importlib.import_module("hyg_prog")
    sys.modules.pop("hyg_prog", None)


def _counted_call(fn, *args) -> int:
    before = Counting.calls
    fn(*args)
    return Counting.calls - before


def _counting_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(8, 5, generator=g, device="cpu").as_subclass(Counting)
    out = torch.randn(8, 5, generator=g, device="cpu").as_subclass(Counting)
    return x, out


def test_recording_adds_no_torch_function_calls(progmod, tmp_path: Path) -> None:
    plain = _counted_call(progmod.affine, *_counting_inputs(1))
    assert plain > 0
    with kdump.recording("hyg_prog:affine", out=tmp_path / "rec") as rec:
        recorded = _counted_call(progmod.affine, *_counting_inputs(2))
    assert len(rec.written) == 1
    assert recorded == plain
    one = _counted_call(
        lambda *a: kdump.dump_call(tmp_path / "one.kdump", progmod.affine, *a),
        *_counting_inputs(3),
    )
    assert one == plain
    for path in (rec.written[0], tmp_path / "one.kdump"):
        call = load_bundle(path).calls[0]
        assert call.outputs is not None and len(call.outputs) >= 1


WRITER = """
import sys, time, torch, kdump, hyg_big
x = torch.randn(6 * 1024 * 1024, generator=torch.Generator().manual_seed(5), device="cpu")
out = torch.empty_like(x)
with kdump.recording("hyg_big:scale", out=sys.argv[1]):
    for _ in range(1000):
        x.add_(1.0)  # new bytes each call: every bundle writes new blobs
        hyg_big.scale(x, out)
"""

BIG = """
def scale(x, out):
    out.copy_(x * 2.0)
"""


def _leftovers(root: Path) -> list[Path]:
    return [
        p
        for p in root.rglob("*")
        if p.is_file()
        and (p.name.endswith(".tmp") or (p.suffix == ".kdump" and p.stat().st_size == 0))
    ]


def _env(mod: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDUMP_")}
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(mod), str(Path(kdump.__file__).parents[1]), *old])
    return env


def _mid_write(out: Path) -> bool:
    """A whole bundle has been written (so one must survive) and another write is under way."""
    files = [p for p in out.rglob("*") if p.is_file()]
    whole = any(p.suffix == ".kdump" and p.stat().st_size > 0 for p in files)
    return whole and any(p.name.endswith(".tmp") for p in files)


def _kill_mid_write(out: Path, mod: Path, delay: float) -> bool:
    """Run the writer until it is mid-write, SIGKILL it `delay` s later; whether a
    temporary or reserved name was left behind."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], env=_env(mod))
    try:
        deadline = time.monotonic() + 120
        while not _mid_write(out):
            assert proc.poll() is None, "the writer ended before writing anything"
            assert time.monotonic() < deadline, "no temporary file seen in 120 s"
            time.sleep(0.005)
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return bool(_leftovers(out))


def test_temporaries_of_a_killed_writer_are_removed_at_the_next_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "hyg_big.py").write_text(BIG)
    (mod / "hyg_prog.py").write_text(PROGRAM)
    monkeypatch.syspath_prepend(str(mod))
    sys.modules.pop("hyg_prog", None)
    import hyg_prog

    out = tmp_path / "rec"
    left = [_kill_mid_write(out, mod, delay) for delay in (0.0, 0.01, 0.05)]
    assert any(left), "no kill landed mid-write: the test proves nothing"
    # A live writer's temporary (this process) and one of another host are not touched.
    blobs = out / "blobs"
    live = blobs / f".x.{os.getpid()}@{socket.gethostname().replace('.', '-')}.abc123.tmp"
    other = blobs / ".y.1@some-other-host.abc123.tmp"
    for p in (live, other):
        p.write_bytes(b"partial")
    x, o = _counting_inputs(4)
    with kdump.recording("hyg_prog:affine", out=out) as rec:
        hyg_prog.affine(x.as_subclass(torch.Tensor), o.as_subclass(torch.Tensor))
    assert len(rec.written) == 1
    assert sorted(_leftovers(out)) == sorted([live, other])
    bundles = list_bundles(out)
    assert len(bundles) >= 2 and rec.written[0] in bundles
    for path in bundles:
        calls = load_bundle(path).calls
        assert len(calls) == 1
        x_rec, out_rec = calls[0].args  # both targets take (x, out)
        assert x_rec.numel() > 0 and x_rec.shape == out_rec.shape
    sys.modules.pop("hyg_prog", None)


def test_salvage_removes_temporaries_of_dead_writers_only(tmp_path: Path) -> None:
    from kdump.cli import main

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname().replace(".", "-")
    out = tmp_path / "crash"
    (out / "blobs" / "ab").mkdir(parents=True)
    stale = out / "blobs" / "ab" / f".abcd.{dead.pid}@{host}.q1w2e3.tmp"
    live = out / f".b.kdump.{os.getpid()}@{host}.q1w2e3.tmp"
    for p in (stale, live):
        p.write_bytes(os.urandom(64))
    journals = tmp_path / "journals"
    journals.mkdir()
    with pytest.raises(SystemExit) as done:
        main(["salvage", str(journals), "-o", str(out)])
    assert done.value.code == 0
    assert not stale.exists() and live.exists()
