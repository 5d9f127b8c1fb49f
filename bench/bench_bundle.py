"""Bundle write / load throughput against safetensors and a raw file write of the same bytes.

    python bench/bench_bundle.py                 # 2 GB: 8 tensors x 256 MB of mixed dtypes
    python bench/bench_bundle.py --gb 0.25       # smoke run

Write: kdump `save_calls` of a captured call (SHA-256 names and xxh3-128 checks of every blob +
the file) vs `safetensors.torch.save_file` of the same tensors vs one raw `write` of the same
bytes. The call also passes views with storage offsets and views sharing a storage (no extra
bytes; safetensors gets the base tensors). Capturing (the snapshot a recorder takes before the
kernel runs) is timed separately. Load: `load_bundle` + `materialize("cpu")` with checksums
verified, and with `verify=False`, vs `safetensors.torch.load_file`; every side is timed until
every byte has been touched (a sum over a uint8 view). The page cache cannot be dropped here, so
the sides run alternately and the median of `--repeat` rounds counts.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _machine import cpu_model

DTYPES = [
    torch.float8_e4m3fn,
    torch.bfloat16,
    torch.float32,
    torch.int32,
    torch.uint8,
    torch.float16,
    torch.int64,
    torch.float8_e8m0fnu,
]


def make_tensors(total_bytes: int, count: int) -> dict[str, torch.Tensor]:
    """`count` contiguous tensors of mixed dtypes, `total_bytes` in all, random bits."""
    per = total_bytes // count
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        n = per // dtype.itemsize // 1024 * 1024
        raw = torch.randint(-(2**62), 2**62, (n * dtype.itemsize // 8,), generator=gen)
        out[f"t{i}"] = raw.view(dtype).reshape(-1, 1024)
    return out


def touch(tensors: list[torch.Tensor]) -> int:
    """Read every byte (so lazily mapped data really is loaded)."""
    total = 0
    for t in tensors:
        st = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        n8 = st.numel() // 8 * 8  # sum 8-byte words (fast), then the tail bytes
        total += int(st[:n8].view(torch.int64).sum()) + int(st[n8:].sum())
    return total


def best_of(
    repeat: int,
    fns: dict[str, Callable[[], object]],
    between: Callable[[], object] | None = None,
    warmup: int = 0,
) -> dict[str, float]:
    """Run the functions alternately `repeat` times; the median time of each. `between` runs,
    untimed, after each function; `warmup` rounds run first, untimed."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(warmup + repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
            if between is not None:
                between()
    return {k: statistics.median(v) for k, v in times.items()}


def machine() -> str:
    return (
        f"{platform.node()}: {cpu_model()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}, torch {torch.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="total bytes in GB (default 2)")
    ap.add_argument("--tensors", type=int, default=8, help="number of tensors (default 8)")
    ap.add_argument("--repeat", type=int, default=5, help="rounds per side; the median counts")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    args = ap.parse_args(argv)

    from safetensors.torch import load_file, save_file

    from kdump.bundle import capture_call, load_bundle, save_calls
    from kdump.bundle.store import fast_checksum, hasher, pool

    def blob_check(view: memoryview) -> str:
        h = hasher(fast_checksum())
        h.update(view)
        return h.hexdigest()

    total = int(args.gb * 1e9)
    need = 3 * total + (1 << 30)
    free = shutil.disk_usage(args.dir).free
    if free < need:
        print(f"bench_bundle: {args.dir} has {free / 1e9:.1f} GB free, needs {need / 1e9:.1f} GB")
        return 2
    tensors = make_tensors(total, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    names = list(tensors)
    work = Path(tempfile.mkdtemp(prefix="kdump-bench-", dir=args.dir))
    f_kd, f_st, f_raw = work / "b.kdump", work / "b.safetensors", work / "b.raw"
    try:
        t0 = time.perf_counter()
        views = [tensors[names[0]][3:], tensors[names[1]].t(), tensors[names[2]][:, 7:]]
        rec = capture_call("bench:fn", [tensors[n] for n in names] + views)
        t_capture = time.perf_counter() - t0

        def raw_write() -> None:
            with open(f_raw, "wb") as f:
                for t in tensors.values():
                    f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))

        writes = best_of(
            args.repeat,
            {
                "safetensors": lambda: save_file(tensors, str(f_st)),
                "kdump": lambda: save_calls(f_kd, [rec]),
                "raw": raw_write,
            },
            # Every timed write makes a new file, as a recorder does (replacing a large file
            # would time the kernel freeing the old one's pages).
            between=lambda: [p.unlink(missing_ok=True) for p in (f_kd, f_st, f_raw)],
        )
        save_file(tensors, str(f_st))  # the load rounds read these (written untimed)
        save_calls(f_kd, [rec])

        def kd_load() -> None:
            mc = load_bundle(f_kd).calls[0].materialize("cpu")
            touch(mc.tensors[: len(names)])

        def kd_load_unverified() -> None:
            mc = load_bundle(f_kd, verify=False).calls[0].materialize("cpu")
            touch(mc.tensors[: len(names)])

        def st_load() -> None:
            touch(list(load_file(str(f_st)).values()))

        def copy_only() -> None:  # what any loader that copies pays (fresh memory + memcpy)
            touch([torch.empty_like(t).copy_(t) for t in tensors.values()])

        def sha_only() -> None:  # what SHA-256 of every byte costs (one thread per blob)
            views = [memoryview(t.view(torch.uint8).reshape(-1).numpy()) for t in tensors.values()]
            with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                list(pool.map(lambda v: hashlib.sha256(v).digest(), views))

        def fast_only() -> None:  # what the fast per-blob check of every byte costs
            views = [memoryview(t.view(torch.uint8).reshape(-1).numpy()) for t in tensors.values()]
            list(pool().map(blob_check, views))

        loads = best_of(
            args.repeat,
            {
                "safetensors": st_load,
                "kdump": kd_load,
                "kdump-noverify": kd_load_unverified,
                "copy": copy_only,
                "sha": sha_only,
                "fast": fast_only,
            },
        )
        # correctness of what was timed
        mc = load_bundle(f_kd).calls[0].materialize("cpu")
        assert all(
            torch.equal(a.view(torch.uint8), tensors[n].view(torch.uint8))
            for a, n in zip(mc.tensors, names)
        )
        for got, want in zip(mc.tensors[len(names) :], views):
            assert got.storage_offset() == want.storage_offset()
            bits = [t.contiguous().view(torch.uint8) for t in (got, want)]
            assert torch.equal(*bits)  # bits: random payloads hold NaNs
        del mc
        size_kd, size_st = f_kd.stat().st_size, f_st.stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)

    # (phase, what, key): each row's ratio is safetensors' time over its own.
    table = (
        ("write", "safetensors save_file", "safetensors"),
        ("write", "kdump save_calls", "kdump"),
        ("write", "raw file write", "raw"),
        ("load", "safetensors load_file + touch", "safetensors"),
        ("load", "kdump load+materialize+verify+touch", "kdump"),
        ("load", "kdump load+materialize+touch, verify=False", "kdump-noverify"),
        ("load", "ref: copy to fresh memory + touch", "copy"),
        ("load", "ref: SHA-256 of every byte (parallel)", "sha"),
        ("load", f"ref: {fast_checksum().value} of every byte (parallel)", "fast"),
    )
    rows = []
    for phase, what, key in table:
        times = writes if phase == "write" else loads
        t = times[key]
        rows.append((phase, what, t, nbytes / t / 1e9, times["safetensors"] / t))
    dtypes = ", ".join(str(t.dtype).removeprefix("torch.") for t in tensors.values())
    lines = [
        f"{nbytes / 1e9:.2f} GB in {len(tensors)} tensors ({dtypes}) and {len(views)} views; "
        f"median of {args.repeat}; "
        f"files in {args.dir}; kdump file {size_kd} B, safetensors {size_st} B",
        "",
        "| op | what | seconds | GB/s | speed vs safetensors |",
        "|---|---|---:|---:|---:|",
        *(f"| {op} | {what} | {s:.3f} | {g:.2f} | {r:.2f}× |" for op, what, s, g, r in rows),
        f"| write | kdump capture_call (snapshot, once) | {t_capture:.3f} | "
        f"{nbytes / t_capture / 1e9:.2f} | |",
        "",
        f"kdump write = {writes['safetensors'] / writes['kdump']:.2f}× safetensors, "
        f"{writes['raw'] / writes['kdump']:.2f}× raw write; "
        f"kdump load = {loads['safetensors'] / loads['kdump']:.2f}× safetensors verified (goal ≥ "
        f"0.5×), {loads['safetensors'] / loads['kdump-noverify']:.2f}× unverified (goal ≥ 0.9×); "
        f"blob check {fast_checksum().value}",
    ]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp} — {machine()}\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
