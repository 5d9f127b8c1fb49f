"""Golden bundles and journals: written from fixed inputs (fixed clock, host, process id and
addresses) through the public writing paths, kept under tests/data/golden/ and compared byte for
byte by tests/test_golden.py. A change to the bytes kdump writes shows up there as a failure; a
deliberate format change rewrites them with `python -m tests.golden` and says so in FORMAT.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

from kdump import config
from kdump.bundle import attach_outputs, capture_call, pack, save_calls
from kdump.bundle.store import BlobStore

HERE = Path(__file__).parent / "data" / "golden"
CLOCK = 1_765_000_000.25
HOST = "golden-host"
PID = 4242
BASE = 0x7F00_0000_0000
TARGET = "tests.golden:kernel"
ENV = {"kdump_version": "golden", "python": "3.x", "torch": "golden"}


def kernel(a: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, k: int) -> None:
    out.copy_(a[: out.shape[0], : out.shape[1]] * k)


@contextmanager
def fixed() -> Iterator[None]:
    """The clock, host name, process id, argv and (empty) recorded environment every golden
    file is written under: CUDA_* and friends differ from machine to machine."""
    with (
        mock.patch.object(time, "time", lambda: CLOCK),
        mock.patch.object(time, "time_ns", lambda: int(CLOCK * 1e9)),
        mock.patch.object(socket, "gethostname", lambda: HOST),
        mock.patch.object(os, "getpid", lambda: PID),
        mock.patch.object(sys, "argv", ["golden"]),
        mock.patch.object(config, "recorded_environment", lambda env=None: {}),
    ):
        yield


def _fixed_addresses(captured: object) -> None:
    """Rewrites the recorded addresses of a capture to fixed ones (1 MiB apart per storage,
    each tensor keeping its offset from its storage)."""
    sts = captured.storages  # type: ignore[attr-defined]
    for i, st in enumerate(sts):
        sts[i] = dataclasses.replace(st, base_ptr=BASE + (i << 20))
    tens = captured.tensors  # type: ignore[attr-defined]
    for i, t in enumerate(tens):
        st = sts[t.storage]  # already moved
        tens[i] = dataclasses.replace(t, data_ptr=st.base_ptr + t.storage_offset * t.itemsize)


def make_call(seed: int, outputs: bool = True) -> object:
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(16, 24, generator=g)
    view = a[2:, 3:7]  # shares a's storage: one payload, two layouts
    idx = torch.randint(-1000, 1000, (37,), generator=g, dtype=torch.int32)
    out = torch.zeros(4, 8)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    args = [a, view, idx, out, 3]
    kw = {"scale": 0.5, "b": b}
    call = capture_call(TARGET, args, kw, names=["a", "v", "idx", "out", "k"])
    if outputs:
        kernel(a, view, idx, out, 3)
        attach_outputs(call, [a, view, idx, out, b], [3])
    _fixed_addresses(call.inputs)  # type: ignore[attr-defined]
    if call.outputs is not None:  # type: ignore[attr-defined]
        _fixed_addresses(call.outputs)  # type: ignore[attr-defined]
    call.meta.update({"call_index": seed, "pid": PID, "host": HOST})  # type: ignore[attr-defined]
    return call


_ARENA = 0x7E00_0000_0000
_MAPPED: set[int] = set()


def arena_tensors(seed: int) -> list[torch.Tensor]:
    """The golden call's tensors placed at fixed addresses (an anonymous mapping made at a
    fixed address), so that a recorder that reads live addresses writes the same bytes."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    size = 1 << 20
    want = _ARENA + seed * size
    if want not in _MAPPED:  # mapped once per process, reused by a second writing
        fixed_noreplace = 0x100000
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | fixed_noreplace
        got = libc.mmap(want, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if got != want:
            raise OSError(ctypes.get_errno(), f"cannot map the golden arena at {want:#x}")
        _MAPPED.add(want)
    raw = (ctypes.c_uint8 * size).from_address(want)
    buf = torch.frombuffer(raw, dtype=torch.uint8)
    g = torch.Generator(device="cpu").manual_seed(seed)

    def place(src: torch.Tensor, at: int) -> torch.Tensor:
        n = src.numel() * src.element_size()
        t = buf[at : at + n].view(src.dtype).view(src.shape)
        t.copy_(src)
        return t

    a = place(torch.randn(16, 24, generator=g), 0)
    idx = place(torch.randint(-1000, 1000, (37,), generator=g, dtype=torch.int32), 4096)
    out = place(torch.zeros(4, 8), 8192)
    b = place(torch.randn(40, generator=g).to(torch.bfloat16), 12288)
    return [a, a[2:, 3:7], idx, out, b]


def _flight(root: Path) -> None:
    """The flight recorder's journal and the bundles its flush writes, for three calls."""
    import kdump
    from kdump.record.config import RingConfig

    ring = RingConfig(slots=4, slot_bytes=32 << 10, journal_dir=Path("shm"))
    with kdump.recording(TARGET, out="flight", mode="ring", ring=ring) as rec:
        for seed in (1, 2, 3):
            a, v, idx, out, _ = arena_tensors(seed)
            importlib.import_module("tests.golden").kernel(a, v, idx, out, 3)  # the hooked one
        jpath = rec.recorder.journal.path
        (root / "flight-journal.bin").write_bytes(jpath.read_bytes())
        rec.flush()
    for p in list((root / "flight").rglob("*.json")):
        p.unlink()  # run reports naming this run's folders, not a format


def write_all(root: Path) -> list[Path]:
    """Writes every golden file under `root`; returns them (relative paths are stable)."""
    from kdump.record.flight.journal import Journal, meta_from_call
    from kdump.record.flight.salvage import salvage_journal

    root.mkdir(parents=True, exist_ok=True)
    calls = [make_call(s) for s in (1, 2, 3)]
    with fixed():
        save_calls(root / "one.kdump", calls[:1], env=ENV)
        save_calls(root / "three.kdump", calls, env=ENV)
        store = BlobStore(root / "store")
        save_calls(root / "store" / "stored.kdump", calls[:2], env=ENV, store=store)
        pack(root / "store" / "stored.kdump", root / "packed.kdump")
        jdir = root / "jnl"
        jdir.mkdir(exist_ok=True)
        proc = {"argv": ["python", "serve.py"], "env": {"CUDA_VISIBLE_DEVICES": "0"}}
        j = Journal.create(jdir, slots=4, slot_bytes=32 << 10, process_info=proc)
        for i, c in enumerate(calls):
            payloads = [d.numpy().tobytes() for d in c.inputs.data]  # type: ignore[attr-defined]
            j.record(meta_from_call(c, call_index=i, target_id=1, stream=0x10 + i), payloads)
        j.close()
        jpath = root / "journal.bin"
        os.replace(j.path, jpath)
        here = Path.cwd()
        os.chdir(root)  # the bundles name the journal they came from: a relative, stable path
        try:
            salvage_journal("journal.bin", "salvaged", remove=False)
            _flight(Path("."))
        finally:
            os.chdir(here)
        for report in (root / "salvaged").glob("*.json"):
            report.unlink()  # a run report naming this run's folders, not a format
    return sorted(p for p in root.rglob("*") if p.is_file())


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for p in write_all(out):
        print(p, p.stat().st_size)
