"""Recording cost: per-call host cost of sync recording, and dump_call's write rate.

    python bench/bench_record.py                # CPU parts (and the GPU part where CUDA is)
    python bench/bench_record.py --calls 2000   # shorter run of the per-call part
    python bench/bench_record.py --gpu          # only the GPU part (needs CUDA)

1. Sync recording of a small call (two 1 KiB tensors): host time of recorded call 10 and of the
   calls around call `--calls` (the same within noise: nothing grows with the number of bundles),
   against an atomic write (temporary file + rename) of a new file of the bundle's size, one
   after each recorded call.
2. `kdump.dump_call` of a `--mb` MB call (mixed dtypes, a view with a storage offset, a shared
   storage) against `safetensors.torch.save_file` of the same tensors, median of `--repeat`;
   each timed write makes a new file (the previous one is deleted untimed). Also the same call
   recorded by sync recording into a capture directory, and the floor of any writer that names
   its blobs by SHA-256 on this machine (the hashing and one raw write of the bytes).
3. GPU (CUDA only): recording a `--gpu-mb` MB call from GPU memory with dump_call and with sync
   recording (device spans staged through pinned buffers, the copy of one chunk overlapping the
   hashing and the write of the previous one) against a plain copy of the same bytes to pinned
   host memory plus a raw write of them, median of `--repeat`, alternating in one run.

The write path taken apart (piece sizes, the write alone, the recorder's own work, cProfile):
lab/sync_write.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from bench_bundle import best_of as median_time  # alternating runs, median of each
from bench_bundle import machine


def remover(*paths: Path) -> Callable[[], None]:
    """Delete `paths` (untimed), so every timed write makes a new file as a recorder does:
    replacing a large file would time the kernel freeing the old one's pages."""

    def remove() -> None:
        for p in paths:
            p.unlink(missing_ok=True)

    return remove


def _target_module() -> types.ModuleType:
    mod = types.ModuleType("kdump_bench_target")

    def scale(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x * 2)

    mod.scale = scale  # type: ignore[attr-defined]
    scale.__module__ = mod.__name__
    scale.__qualname__ = "scale"
    sys.modules[mod.__name__] = mod
    return mod


def per_call(work: Path, calls: int) -> list[tuple[str, float, float, str]]:
    """(what, wall ms, CPU ms of the calling thread, ratio) rows. The CPU time is what the
    recording costs the calling thread however loaded the machine is (it leaves out time spent
    waiting for a core); both columns have their ratio against the atomic write.

    Each recorded call is followed by an atomic write of a new file of the bundle's size into a
    folder of its own, so both sides see the same machine load and the same growth of their
    folder; a window of recorded calls is compared with the atomic writes of the same window."""
    import kdump
    from kdump.bundle.store import atomic_write

    mod = _target_module()
    x, out = torch.randn(256), torch.empty(256)
    costs: list[tuple[float, float]] = []
    writes: list[tuple[float, float]] = []
    blob = b""
    with kdump.recording(f"{mod.__name__}:scale", out=work / "rec") as rec:
        for i in range(calls):
            t0, c0 = time.perf_counter(), time.thread_time()
            mod.scale(x, out)
            costs.append((time.perf_counter() - t0, time.thread_time() - c0))
            if i == 0:  # the first bundle holds one more blob (the output's first values)
                continue
            if not blob:
                blob = os.urandom(rec.written[-1].stat().st_size)
            t0, c0 = time.perf_counter(), time.thread_time()
            atomic_write(work / "aw" / f"{i}.bin", blob)
            writes.append((time.perf_counter() - t0, time.thread_time() - c0))
    size = len(blob)
    bare = []
    for _ in range(200):
        t0, c0 = time.perf_counter(), time.thread_time()
        mod.scale(x, out)
        bare.append((time.perf_counter() - t0, time.thread_time() - c0))

    def med(rows: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)

    # writes[i - 1] follows call i: each window of calls against the writes of that window.
    early, late = med(costs[5:15]), med(costs[-100:])
    aw_early, aw_late = med(writes[4:14]), med(writes[-100:])

    def vs(t: tuple[float, float], aw: tuple[float, float]) -> str:
        return f"{t[0] / aw[0]:.2f}× atomic write (CPU {t[1] / aw[1]:.2f}×)"

    return [
        ("bare call", *(v * 1e3 for v in med(bare)), ""),
        (
            "recorded call 10 (median of calls 5-14)",
            *(v * 1e3 for v in early),
            vs(early, aw_early),
        ),
        (
            f"recorded call {calls} (median of the last 100)",
            *(v * 1e3 for v in late),
            f"{vs(late, aw_late)}; {late[0] / early[0]:.2f}× call 10 "
            f"(CPU {late[1] / early[1]:.2f}×)",
        ),
        (f"atomic write of {size} B (after calls 5-14)", *(v * 1e3 for v in aw_early), ""),
        (f"atomic write of {size} B (after the last 100)", *(v * 1e3 for v in aw_late), ""),
    ]


def mixed_call(nbytes: int, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    kinds = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32]
    per = nbytes // len(kinds)
    out = []
    for dtype in kinds:
        n = per // dtype.itemsize // 1024 * 1024
        raw = torch.randint(-(2**62), 2**62, (n * dtype.itemsize // 8,), generator=gen)
        out.append(raw.view(dtype).reshape(-1, 1024).to(device))
    return out


def byte_views(tensors: list[torch.Tensor]) -> list[memoryview]:
    """The bytes of contiguous CPU tensors, without a copy."""
    from kdump.bundle.fileio import cpu_view

    return [cpu_view(t.reshape(-1).view(torch.uint8)) for t in tensors]


def sha_all(tensors: list[torch.Tensor]) -> None:
    from kdump.bundle.store import pool, sha256_hex

    list(pool().map(sha256_hex, byte_views(tensors)))


def sha_serial(tensors: list[torch.Tensor]) -> None:
    from kdump.bundle.store import sha256_hex

    for view in byte_views(tensors):
        sha256_hex(view)


def fast_serial(tensors: list[torch.Tensor]) -> None:
    from kdump.bundle.store import fast_digest

    for view in byte_views(tensors):
        fast_digest(view)


def raw_write(path: Path, tensors: list[torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for view in byte_views(tensors):
            f.write(view)


def pieces_of(tensors: list[torch.Tensor]) -> list[memoryview]:
    """The byte views of `tensors` cut where the writer cuts them (KDUMP_PIECE_BYTES)."""
    from kdump.bundle.store import piece_bytes, piece_cuts

    piece = piece_bytes()
    return [v[lo:hi] for v in byte_views(tensors) for lo, hi in piece_cuts(len(v), piece)]


def write_rate(work: Path, mb: float, repeat: int, device: str) -> dict[str, float]:
    from safetensors.torch import save_file

    import kdump

    tensors = mixed_call(int(mb * 1e6), device)
    # Views with storage offsets and a shared storage cost no extra bytes.
    args = [*tensors, tensors[0][7:], tensors[1][:, 3:]]

    def fn(*a: torch.Tensor) -> None:
        pass

    def pinned_plus_raw() -> None:
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        raw_write(work / "raw.bin", host)

    # Sync recording of the same call into a capture directory (its large spans go straight
    # into the shared store, a file per piece); the recorder stays open over the rounds, so a
    # round after the first finds its blobs present and drops the files it wrote.
    sync_mod = types.ModuleType("kdump_bench_sync")

    def noop(*a: torch.Tensor) -> None:
        pass

    noop.__module__ = sync_mod.__name__
    noop.__qualname__ = "noop"
    sync_mod.noop = noop  # type: ignore[attr-defined]
    sys.modules[sync_mod.__name__] = sync_mod
    recorder = kdump.recording(f"{sync_mod.__name__}:noop", out=work / "sync")
    recorder.__enter__()

    sides: dict[str, Callable[[], object]] = {
        "dump_call": lambda: kdump.dump_call(work / "d.kdump", fn, *args),
        "sync recording": lambda: sync_mod.noop(*args),
    }
    if device == "cpu":
        st = {f"t{i}": t for i, t in enumerate(tensors)}
        sides["save_file"] = lambda: save_file(st, str(work / "s.safetensors"))
        # What naming every blob by its SHA-256 (the format's rule) costs by itself, on the
        # pool the writer hashes with: a floor under dump_call's time on this machine.
        sides["ref: SHA-256 of the bytes"] = lambda: sha_all(tensors)
        # The same work on one thread, and one raw write of the bytes: what any writer that
        # names its blobs by SHA-256 must spend in CPU time (the floor below).
        sides["ref: SHA-256 on one thread"] = lambda: sha_serial(tensors)
        sides["ref: raw write"] = lambda: raw_write(work / "raw.bin", tensors)
        # The fast check digest the format records per blob, and the same read again by the
        # output compare after the call: work dump_call has that save_file has not.
        sides["ref: fast check on one thread"] = lambda: fast_serial(tensors)
    else:
        sides["pinned copy + raw write"] = pinned_plus_raw
    outputs = (work / "d.kdump", work / "s.safetensors", work / "raw.bin")
    try:
        times = median_time(repeat, sides, between=remover(*outputs), warmup=1)
    finally:
        recorder.__exit__(None, None, None)
        shutil.rmtree(work / "sync", ignore_errors=True)
    times["bytes"] = float(sum(t.numel() * t.element_size() for t in tensors))
    if device == "cpu":
        times["largest piece"] = float(max(len(v) for v in pieces_of(tensors)))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=10_000, help="recorded calls (default 10000)")
    ap.add_argument("--mb", type=float, default=156.0, help="dump_call size in MB (default 156)")
    ap.add_argument("--gpu-mb", type=float, default=600.0, help="GPU call size (default 600)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds per side; the median counts")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    ap.add_argument("--gpu", action="store_true", help="only the GPU part (needs CUDA)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kdump-bench-record-", dir=args.dir))
    lines = [machine(), f"load average (1, 5, 15 min) at the start: {_load()}", ""]
    if args.gpu and not torch.cuda.is_available():
        print("bench_record: --gpu needs a CUDA device")
        return 2
    try:
        if not args.gpu:
            lines += cpu_parts(work, args)
        if torch.cuda.is_available():
            lines += gpu_part(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines.append(f"\nload average (1, 5, 15 min) at the end: {_load()}")
    print("\n".join(lines))
    return 0


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_parts(work: Path, args: argparse.Namespace) -> list[str]:
    lines: list[str] = []
    rows = per_call(work, args.calls)
    lines += [
        "Sync recording of a small call (2 x 1 KiB tensors), host time per call:",
        "",
        "| what | ms | CPU ms | ratio |",
        "|---|---:|---:|---|",
        *(f"| {w} | {ms:.3f} | {cpu:.3f} | {r} |" for w, ms, cpu, r in rows),
        "",
    ]
    shutil.rmtree(work / "rec", ignore_errors=True)
    w = write_rate(work, args.mb, args.repeat, "cpu")
    n = w["bytes"]
    lines += [
        f"dump_call of {n / 1e6:.0f} MB on CPU, median of {args.repeat}:",
        "",
        "| what | seconds | MB/s | speed vs save_file |",
        "|---|---:|---:|---:|",
        *(
            f"| {k} | {w[k]:.3f} | {n / w[k] / 1e6:.0f} | {w['save_file'] / w[k]:.2f}× |"
            for k in (
                "save_file",
                "dump_call",
                "sync recording",
                "ref: SHA-256 of the bytes",
                "ref: SHA-256 on one thread",
                "ref: raw write",
                "ref: fast check on one thread",
            )
        ),
        "",
        f"dump_call = {w['save_file'] / w['dump_call']:.2f}× save_file (goal on the H200 host: "
        "≥ 0.9×); every side ran once untimed first (a fresh process's first large write also "
        "pays for its first touch of memory)",
    ]
    # The floor of any writer that names blobs by SHA-256: hashing every byte and writing it
    # once, spread perfectly over the cores (never below the one write or the hashing pool's
    # measured time). The output compare and the fast checks come on top.
    # The largest piece is hashed on one core, at the one-thread rate.
    cores = os.cpu_count() or 1
    largest = w["largest piece"] * w["ref: SHA-256 on one thread"] / w["bytes"]
    floor = max(
        (w["ref: SHA-256 on one thread"] + w["ref: raw write"]) / cores,
        w["ref: raw write"],
        w["ref: SHA-256 of the bytes"],
        largest,
    )
    # With the format's fast check per blob and the output compare's second pass of it.
    fast = w["ref: fast check on one thread"]
    full = max(
        floor,
        (w["ref: SHA-256 on one thread"] + 2 * fast + w["ref: raw write"]) / cores,
        w["ref: raw write"],
        largest * (1 + fast / w["ref: SHA-256 on one thread"]),
    )
    lines.append(
        f"floor on this machine ({cores} cores; the largest piece, "
        f"{w['largest piece'] / 2**20:.0f} MiB, hashed on one core in {largest:.3f} s): "
        f"{floor:.3f} s, so at best "
        f"{w['save_file'] / floor:.2f}× save_file; dump_call = "
        f"{floor / w['dump_call']:.2f}× the floor (goal ≥ 0.9×)"
    )
    lines.append(
        f"with the fast check digests (xxh3-128 when written, again for the output compare): "
        f"{full:.3f} s; dump_call = {full / w['dump_call']:.2f}× that"
    )
    return lines


def gpu_part(work: Path, args: argparse.Namespace) -> list[str]:
    g = write_rate(work, args.gpu_mb, args.repeat, "cuda")
    n = g["bytes"]
    base = g["pinned copy + raw write"]
    return [
        "",
        f"dump_call of {n / 1e6:.0f} MB from GPU memory ({torch.cuda.get_device_name()}), "
        f"median of {args.repeat}:",
        "",
        "| what | seconds | MB/s | speed vs pinned copy + raw write |",
        "|---|---:|---:|---:|",
        *(
            f"| {k} | {g[k]:.3f} | {n / g[k] / 1e6:.0f} | {base / g[k]:.2f}× |"
            for k in ("pinned copy + raw write", "dump_call", "sync recording")
        ),
        "",
        f"GPU dump_call = {base / g['dump_call']:.2f}×, sync recording = "
        f"{base / g['sync recording']:.2f}× pinned copy + raw write (goal ≥ 0.9×)",
    ]


if __name__ == "__main__":
    sys.exit(main())
