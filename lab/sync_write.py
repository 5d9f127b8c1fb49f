"""Sync recording's write path taken apart, beside bench/bench_record.py: the recorder's own work
per small call, a cProfile of recorded small calls, dump_call at other piece sizes, and the write
alone (the same bytes in pieces: one writer, the pool into one file, a file per piece, a shared
map, the one-pass hash + write, and what the bundle writer does), each against one writer of the
same bytes, medians of alternating rounds.

    python lab/sync_write.py [--calls 4000] [--mb 156] [--repeat 5] [--profile N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_bundle import best_of as median_time
from bench_record import _target_module, mixed_call, pieces_of, remover

# Piece sizes dump_call is also timed at beside the default (KDUMP_PIECE_BYTES).
PIECE_CHOICES = ("32M", "64M")


def _recorded_calls(work: Path, calls: int, write: bool) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each of `calls` recorded small calls; with write=False the bundle
    files are built but not written (kdump.bundle.writer's atomic_write replaced)."""
    import kdump
    from kdump.bundle import writer

    mod = _target_module()
    x, out = torch.randn(256), torch.empty(256)
    saved = writer.atomic_write
    if not write:
        writer.atomic_write = lambda path, content: bytes(content)  # type: ignore[assignment]
    rows: list[tuple[float, float]] = []
    try:
        with kdump.recording(f"{mod.__name__}:scale", out=work):
            for _ in range(calls):
                t0, c0 = time.perf_counter(), time.thread_time()
                mod.scale(x, out)
                rows.append((time.perf_counter() - t0, time.thread_time() - c0))
    finally:
        writer.atomic_write = saved
    return rows


def own_work(work: Path, calls: int) -> tuple[float, float]:
    """Median (wall, CPU) ms of the recorder's own work per call over the last half of `calls`
    recorded calls whose bundle files are built, not written."""
    rows = _recorded_calls(work / "own", calls, write=False)[calls // 2 :]
    shutil.rmtree(work / "own", ignore_errors=True)
    return (
        statistics.median(r[0] for r in rows) * 1e3,
        statistics.median(r[1] for r in rows) * 1e3,
    )


def profile(work: Path, calls: int) -> str:
    """cProfile of `calls` recorded small calls (after 200 unprofiled ones), top functions."""
    import cProfile
    import io
    import pstats

    import kdump

    mod = _target_module()
    x, out = torch.randn(256), torch.empty(256)
    prof = cProfile.Profile()
    with kdump.recording(f"{mod.__name__}:scale", out=work / "prof"):
        for _ in range(200):
            mod.scale(x, out)
        prof.enable()
        for _ in range(calls):
            mod.scale(x, out)
        prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    return text.getvalue()


def _pwrite_all(fd: int, view: memoryview, at: int) -> None:
    from kdump.bundle.fileio import pwrite_all

    for lo in range(0, len(view), 1 << 20):  # the writer's pass chunk
        pwrite_all(fd, view[lo : lo + (1 << 20)], at + lo)


def _offsets(views: list[memoryview]) -> list[int]:
    out, pos = [], 0
    for v in views:
        out.append(pos)
        pos += len(v)
    return out


def one_writer(path: Path, views: list[memoryview]) -> None:
    """One thread writes every piece, in order, into one file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for v, at in zip(views, _offsets(views)):
            _pwrite_all(fd, v, at)
    finally:
        os.close(fd)


def parallel_one_fd(path: Path, views: list[memoryview]) -> None:
    """The pool writes the pieces at their offsets into one file through one descriptor."""
    from kdump.bundle.store import pool

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        jobs = [pool().submit(_pwrite_all, fd, v, at) for v, at in zip(views, _offsets(views))]
        for j in jobs:
            j.result()
    finally:
        os.close(fd)


def parallel_files(folder: Path, views: list[memoryview]) -> None:
    """The pool writes each piece into a file of its own (what the shared store does)."""
    from kdump.bundle.store import pool

    folder.mkdir(exist_ok=True)

    def one(i: int, v: memoryview) -> None:
        fd = os.open(folder / f"{i}.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, v, 0)
        finally:
            os.close(fd)

    for j in [pool().submit(one, i, v) for i, v in enumerate(views)]:
        j.result()


def parallel_map(path: Path, views: list[memoryview]) -> None:
    """The pool copies the pieces into a shared map of one file (sized first): page faults of
    one file take no lock that writes of one file take (the inode's), so copies may scale."""
    import ctypes
    import mmap

    from kdump.bundle.store import pool

    offs = _offsets(views)
    total = offs[-1] + len(views[-1]) if views else 0
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, total)
        m = mmap.mmap(fd, total)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))

        def one(v: memoryview, at: int) -> None:
            src = ctypes.addressof(ctypes.c_char.from_buffer(v))
            for lo in range(0, len(v), 1 << 20):
                ctypes.memmove(base + at + lo, src + lo, min(1 << 20, len(v) - lo))

        for j in [pool().submit(one, v, at) for v, at in zip(views, offs)]:
            j.result()
        m.close()
    finally:
        os.close(fd)


def parallel_hash_write(path: Path, views: list[memoryview]) -> None:
    """Each piece hashed and written in one pass by a pool worker (what the store's files of
    their own are written by; the bundle writer did this too before it kept one writer)."""
    from kdump.bundle.fileio import hash_write
    from kdump.bundle.store import pool

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offs = _offsets(views)
        for j in [pool().submit(hash_write, fd, v, at) for v, at in zip(views, offs)]:
            j.result()
    finally:
        os.close(fd)


def hash_beside_one_writer(path: Path, views: list[memoryview]) -> None:
    """What the bundle writer does: the calling thread writes the pieces in file order while
    pool workers hash them (largest first), then hashes what is left beside them."""
    from kdump.bundle.fileio import write_and_hash

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_and_hash(fd, list(zip(views, _offsets(views))), views)
    finally:
        os.close(fd)


def write_apart(work: Path, mb: float, repeat: int) -> dict[str, float]:
    """The parallel write measured on its own against one writer of the same bytes."""
    tensors = mixed_call(int(mb * 1e6), "cpu")
    views = pieces_of(tensors)
    sides: dict[str, Callable[[], object]] = {
        "one writer, one file": lambda: one_writer(work / "w1.bin", views),
        "pool, one descriptor, pwrite at offsets": lambda: parallel_one_fd(work / "wp.bin", views),
        "pool, a file per piece": lambda: parallel_files(work / "wf", views),
        "pool, copies into a shared map of one file": lambda: parallel_map(work / "wm.bin", views),
        "pool, hash + write in one pass": lambda: parallel_hash_write(work / "wh.bin", views),
        "pool hashes, the caller writes (the writer)": lambda: hash_beside_one_writer(
            work / "wo.bin", views
        ),
    }

    def clean() -> None:
        for p in ("w1.bin", "wp.bin", "wh.bin", "wo.bin", "wm.bin"):
            (work / p).unlink(missing_ok=True)
        shutil.rmtree(work / "wf", ignore_errors=True)

    times = median_time(repeat, sides, between=clean, warmup=1)
    times["bytes"] = float(sum(len(v) for v in views))
    times["pieces"] = float(len(views))
    return times


def pieces_rate(work: Path, mb: float, repeat: int) -> dict[str, float]:
    """dump_call of the bench's call at the default piece size and at PIECE_CHOICES."""
    import kdump

    tensors = mixed_call(int(mb * 1e6), "cpu")
    args = [*tensors, tensors[0][7:], tensors[1][:, 3:]]

    def fn(*a: torch.Tensor) -> None:
        pass

    def dump_in(piece: str | None) -> Callable[[], object]:
        def side() -> object:
            kept = os.environ.get("KDUMP_PIECE_BYTES")
            if piece is not None:
                os.environ["KDUMP_PIECE_BYTES"] = piece
            try:
                return kdump.dump_call(work / "d.kdump", fn, *args)
            finally:
                if kept is None:
                    os.environ.pop("KDUMP_PIECE_BYTES", None)
                else:
                    os.environ["KDUMP_PIECE_BYTES"] = kept

        return side

    sides = {"dump_call (default pieces)": dump_in(None)}
    sides |= {f"dump_call, pieces of {p}iB": dump_in(p) for p in PIECE_CHOICES}
    times = median_time(repeat, sides, between=remover(work / "d.kdump"), warmup=1)
    times["bytes"] = float(sum(t.numel() * t.element_size() for t in tensors))
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=4000, help="recorded small calls")
    ap.add_argument("--mb", type=float, default=156.0, help="the large call in MB")
    ap.add_argument("--repeat", type=int, default=5, help="rounds per side; the median counts")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    ap.add_argument("--profile", type=int, metavar="N", help="cProfile of N recorded calls")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kdump-lab-write-", dir=args.dir))
    try:
        if args.profile:
            print(profile(work, args.profile))
            return 0
        wall, cpu = own_work(work, args.calls)
        print(
            f"recorder's own work per small call (bundle bytes built, not written): "
            f"{wall:.3f} ms, CPU {cpu:.3f} ms"
        )
        p = pieces_rate(work, args.mb, args.repeat)
        n = p.pop("bytes")
        for k, t in p.items():
            print(f"{k}: {t:.3f} s, {n / t / 1e6:.0f} MB/s")
        from kdump.bundle.store import HASH_THREADS, piece_bytes

        a = write_apart(work, args.mb, args.repeat)
        one = a["one writer, one file"]
        print(
            f"\nThe write alone: {a['bytes'] / 1e6:.0f} MB in {a['pieces']:.0f} pieces (piece "
            f"size {piece_bytes() >> 20} MiB, pool of {HASH_THREADS}), median of {args.repeat}:\n"
        )
        print("| what | seconds | MB/s | speed vs one writer |\n|---|---:|---:|---:|")
        for k in a:
            if k not in ("bytes", "pieces"):
                print(f"| {k} | {a[k]:.3f} | {a['bytes'] / a[k] / 1e6:.0f} | {one / a[k]:.2f}× |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
