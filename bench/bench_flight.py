"""The flight recorder's cost on a GPU, measured in one run against baselines of the same run.

Reference shapes G=288 with N=512, K=4096 (w13) and N=4096, K=256 (w2); 1, 32 and 113 tokens per
expert (A is always 36,864 rows: every expert padded to 128). For each:

* graph step (CUDA-graph replay of the GEMM) without the recorder, and with it:
  (i) metadata and scales only (A's rows not gathered), (ii) with activations (A's valid rows),
  each with a salvage process holding the device tier (host copy on a side branch) and without
  (host copy before the kernel); for (ii) the HBM bound of copying those rows (their bytes at the
  plain D2D rate measured here), the floor it sets ((plain + bound) / plain: no recorder that
  copies those rows before the kernel steps faster) and the added time against the bound;
* eager host time per call, unhooked and recorded (the call signature cache warm), at least
  400 calls timed in chunks with the device synchronised between them (bench/_timing.py), and
  recorded with A, its scales, D and the labels new tensor objects over the same memory at
  every call (a serving loop's step; the weights the same objects);

then the copy throughput of each tier: the snapshot kernel's D2D against a plain D2D copy of the
same bytes, the journal's pinned D2H against a plain pinned buffer; then the outputs column: a
generic target (no spec: `scale(x, out)`, `torch.mul(x, 2, out=out)`, x and out of
`--generic-kib` each) whose graph step and eager call are recorded with `--outputs none` and
with its outputs kept (the default for a target without a reference spec: out copied into the
slot after the kernel, a captured node in the graph), with and without a salvage process
holding the device tier (DeepGEMM keeps none by default: the rows above are its cost).

    python bench/bench_flight.py [--iters 50] [--pdl] [--shape 512x4096] [--tokens 1,32]
        [--generic-kib 64,512] [--only-generic]

`--pdl` launches the GEMM with programmatic dependent launch (DeepGEMM's `set_pdl(True)`), every
column of the run. The floors of any device-side recorder (empty nodes, a kernel that copies the
touched rows and publishes nothing) and variants of the snapshot kernel are lab/flight_variants.py.

Needs DeepGEMM (the GEMM measured) or --backend packaged (kdump's packaged kernel).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _timing import CHUNK, host_us, new_step_objects

import kdump
from kdump.kernels import registry
from kdump.record.config import RingConfig
from kdump.record.flight import plan as ring_mod

SHAPES = ((512, 4096), (4096, 256))
TOKENS = (1, 32, 113)
G = 288
TARGET = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
MODULES = {"deep_gemm": "deep_gemm", "packaged": "kdump.kernels.sm120.api"}


def case(n: int, k: int, tokens: int) -> tuple[tuple, dict]:
    spec = registry.spec_for(TARGET)
    args, kwargs = spec.generate(
        seed=1, device="cuda", scale_format="fp32", num_groups=G, n=n, k=k, expected_m=tokens
    )
    # exactly `tokens` rows per expert
    labels = args[3]
    rows = torch.arange(labels.numel(), device=labels.device)
    labels.copy_(torch.where(rows % 128 < tokens, rows // 128, -1).to(torch.int32))
    return tuple(args), kwargs


def gemm(backend: str) -> Callable[..., Any]:
    """The grouped GEMM of `backend`, called by module attribute at call time (so the recorder's
    hook on deep_gemm's name is taken); the packaged kernel is recorded under that name."""
    import sys
    import types

    module = importlib.import_module(MODULES[backend])
    if backend == "packaged":
        sys.modules.setdefault("deep_gemm", types.ModuleType("deep_gemm"))
        sys.modules["deep_gemm"].m_grouped_fp8_gemm_nt_contiguous = (  # type: ignore[attr-defined]
            module.m_grouped_fp8_gemm_nt_contiguous
        )
        module = sys.modules["deep_gemm"]

    def fn(*a: Any, **k: Any) -> Any:
        return module.m_grouped_fp8_gemm_nt_contiguous(*a, **k)

    return fn


def _graph_ms(fn: Callable[..., Any], args: tuple, kwargs: dict, iters: int) -> float:
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args, **kwargs)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):  # best of three batches: other work on the host shifts single batches
        t0 = time.perf_counter()
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters * 1e3)
    return best


def _eager_host_us(
    fn: Callable[..., Any], args: tuple, kwargs: dict, iters: int, renew: bool = False
) -> float:
    """`renew`: every call's activations, output and labels new objects over the same memory."""
    fresh = new_step_objects if renew else None
    for _ in range(3):
        fn(*(fresh(args) if fresh else args), **kwargs)
    return host_us(fn, args, kwargs, max(iters, 10 * CHUNK), fresh=fresh)


def _d2d_gbs(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 20 * nbytes / (time.perf_counter() - t0) / 1e9


class _ScalesOnly:
    """Plans without A's data rows: case (i), metadata and scales only."""

    def __enter__(self) -> None:
        self.orig = ring_mod.plan_for

        def plan_for(st: Any, args: Any, kwargs: Any, tensors: Any) -> Any:
            plan, rule = self.orig(st, args, kwargs, tensors)
            if plan is None or len(plan.gathers) < 2:
                return None, None
            from dataclasses import replace

            from kdump.record.flight.gather import RECORD_HEAD

            keep = plan.gathers[1:]
            off, moved = RECORD_HEAD, []
            for g in keep:
                moved.append(replace(g, rec_off=off))
                off = -(-(off + g.row_bytes) // 16) * 16
            return replace(plan, gathers=tuple(moved), rec_bytes=off), rule

        ring_mod.plan_for = plan_for

    def __exit__(self, *exc: object) -> None:
        ring_mod.plan_for = self.orig


def _recorded(
    fn: Callable[..., Any], args: tuple, kwargs: dict, shm: Path, held: bool, iters: int
) -> tuple[float, float, dict, float]:
    ring = RingConfig(slots=64, slot_bytes=1 << 20, journal_dir=shm, device_bytes=1 << 30)
    with kdump.recording("deep_gemm", out=shm / "out", mode="ring", ring=ring) as rec:
        fn(*args, **kwargs)  # the journal and the device tier are made here
        cuda = rec.recorder._cuda
        if cuda is None or cuda.tier is None:
            raise SystemExit(f"no device tier: {cuda.facts() if cuda else 'no CUDA side'}")
        cuda.tier.held = held  # as if a salvage process held it (or not)
        host = _eager_host_us(fn, args, kwargs, iters)
        renewed = _eager_host_us(fn, args, kwargs, iters, renew=True)
        step = _graph_ms(fn, args, kwargs, iters)
        facts = cuda.facts()
        # Leaving writes every slot as a bundle: not what this bench measures (the salvage's
        # time is lab/profile_recorder.py's), and it took most of the run's time.
        rec.recorder.flush = lambda: None
    return step, host, facts, renewed


GENERIC = "kdump_bench_generic:scale"
GENERIC_KIB = (64, 512)
GENERIC_HEADER = (
    "| x, out KiB each (slot) | plain ms | none, held | kept, held | none, not held | "
    "kept, not held | eager us plain | eager us none | eager us kept | outputs held |"
)


def generic_module() -> types.ModuleType:
    """The outputs column's target, put in sys.modules: no spec, so the flight recorder keeps
    its outputs by default."""
    mod = types.ModuleType("kdump_bench_generic")

    def scale(x: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(x, 2, out=out)

    mod.scale = scale  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    return mod


def _generic_fn() -> Callable[..., Any]:
    mod = sys.modules.get("kdump_bench_generic") or generic_module()

    def fn(*a: Any) -> Any:  # by attribute at call time: the recorder's hook is taken
        return mod.scale(*a)

    return fn


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize()


def _generic_host_us(fn: Callable[..., Any], args: tuple, calls: int) -> float:
    """Host µs per eager call, in chunks with the device synchronised between them (CPU
    tensors: no device to wait for)."""
    for _ in range(3):
        fn(*args)
    _sync(args[0])
    total, done = 0.0, 0
    while done < calls:
        n = min(CHUNK, calls - done)
        t = time.perf_counter()
        for _ in range(n):
            fn(*args)
        total += time.perf_counter() - t
        _sync(args[0])
        done += n
    return total / calls * 1e6


def generic_slot_bytes(nbytes: int) -> int:
    """A slot that holds both arguments before the call and both again after it (the
    default keeps every tensor argument of a generic target): 1 MiB, doubled as needed."""
    slot = 1 << 20
    while slot * 0.9 < 4 * (nbytes + 64):
        slot *= 2
    return slot


def generic_recorded(
    x: torch.Tensor, out: torch.Tensor, shm: Path, outputs: str, held: bool, iters: int
) -> dict[str, Any]:
    """The generic target recorded with `--outputs` `outputs`: "host" (µs per eager call),
    "step" (ms per graph replay; CUDA tensors only) and "held" (whether the journal's newest
    complete slot holds the outputs of its call, read after the copies landed)."""
    from kdump.format.journal import SlotState
    from kdump.record.flight.journal_reader import read_journal

    fn = _generic_fn()
    device_bytes = 1 << 30 if x.is_cuda else 0
    slot = generic_slot_bytes(x.numel() * x.element_size())
    ring = RingConfig(slots=64, slot_bytes=slot, journal_dir=shm, device_bytes=device_bytes)
    res: dict[str, Any] = {}
    with kdump.recording(
        GENERIC, out=shm / "out-generic", mode="ring", ring=ring, outputs=outputs
    ) as rec:
        fn(x, out)  # the journal (and the device tier) are made here
        cuda = rec.recorder._cuda
        if cuda is not None and cuda.tier is not None:
            cuda.tier.held = held  # as if a salvage process held it (or not)
        res["host"] = _generic_host_us(fn, (x, out), max(iters, 2 * CHUNK))
        if x.is_cuda:
            res["step"] = _graph_ms(fn, (x, out), {}, iters)
            assert cuda is not None
            with rec.recorder.lock:
                cuda.drain(wait=True)
            torch.cuda.synchronize()
        slots = read_journal(rec.recorder.journal.path).having(SlotState.COMPLETE)
        res["held"] = bool(slots) and slots[0].outputs_held
        # Leaving would write every slot as a bundle: not what this measures.
        rec.recorder.flush = lambda: None
    return res


def generic_row(kib: int, plain_ms: float | None, plain_us: float, res: dict) -> str:
    """One row of the outputs column's table (`GENERIC_HEADER`); `res[outputs, held]` as
    `generic_recorded` returns them."""

    def step(key: tuple[str, bool]) -> str:
        ms = res[key].get("step")
        if ms is None or plain_ms is None:
            return "-"
        return f"{ms:.4f} ({ms / plain_ms:.2f}x)"

    none_us = statistics.median(res[k]["host"] for k in res if k[0] == "none")
    kept_us = statistics.median(res[k]["host"] for k in res if k[0] == "default")
    cells = [
        f"{kib} ({generic_slot_bytes(kib * 1024) >> 20}M)",
        f"{plain_ms:.4f}" if plain_ms is not None else "-",
        step(("none", True)),
        step(("default", True)),
        step(("none", False)),
        step(("default", False)),
        f"{plain_us:.1f}",
        f"{none_us:.1f} (+{none_us - plain_us:.1f})",
        f"{kept_us:.1f} (+{kept_us - plain_us:.1f})",
        "yes" if all(res[k]["held"] for k in res if k[0] == "default") else "no",
    ]
    return "| " + " | ".join(cells) + " |"


def generic_table(shm: Path, sizes_kib: list[int], iters: int, device: str) -> list[str]:
    """The outputs column: a row per size (x and out of that many KiB each)."""
    rows = [GENERIC_HEADER, "|" + "---|" * 10]
    fn = _generic_fn()
    for kib in sizes_kib:
        n = max(1, kib * 1024 // 4)
        x = torch.randn(n, device=device)
        out = torch.zeros(n, device=device)
        plain_ms = _graph_ms(fn, (x, out), {}, iters) if x.is_cuda else None
        plain_us = _generic_host_us(fn, (x, out), max(iters, 2 * CHUNK))
        res = {
            (outputs, held): generic_recorded(x, out, shm, outputs, held, iters)
            for held in (True, False)
            for outputs in ("none", "default")
        }
        rows.append(generic_row(kib, plain_ms, plain_us, res))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--backend", choices=sorted(MODULES), default="deep_gemm")
    p.add_argument("--pdl", action="store_true", help="launch the GEMM with PDL (set_pdl)")
    p.add_argument("--shape", action="append", default=[], metavar="NxK", help="only these")
    p.add_argument("--tokens", default="", metavar="T,...", help="only these tokens per expert")
    p.add_argument(
        "--generic-kib",
        default=",".join(map(str, GENERIC_KIB)),
        metavar="KIB,...",
        help="the outputs column's sizes of x and out",
    )
    p.add_argument(
        "--only-generic", action="store_true", help="only the outputs column (no GEMM needed)"
    )
    opt = p.parse_args()
    generic_kib = [int(v) for v in opt.generic_kib.split(",") if v]
    if opt.only_generic:
        shm = Path(tempfile.mkdtemp(prefix="kdump-bench-", dir="/dev/shm"))
        print("\n".join(generic_table(shm, generic_kib, opt.iters, "cuda")))
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in opt.shape] or list(SHAPES)
    token_counts = [int(t) for t in opt.tokens.split(",") if t] or list(TOKENS)
    fn = gemm(opt.backend)
    if opt.pdl:
        import deep_gemm

        if not hasattr(deep_gemm, "set_pdl"):
            raise SystemExit("--pdl: this deep_gemm has no set_pdl")
        deep_gemm.set_pdl(True)
        print(f"GEMM launched with PDL (deep_gemm.get_pdl() = {deep_gemm.get_pdl()})")

    shm = Path(tempfile.mkdtemp(prefix="kdump-bench-", dir="/dev/shm"))
    d2d = _d2d_gbs(256 << 20)
    print(f"plain D2D: {d2d:.0f} GB/s (HBM bound below uses it)\n")
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    facts: dict = {}
    for n, k in shapes:
        for tokens in token_counts:
            args, kwargs = case(n, k, tokens)
            cells, facts = case_cells(fn, args, kwargs, k, tokens, d2d, shm, opt.iters)
            print(f"| {n} | {k} | {tokens} | " + " | ".join(cells) + " |")
    print(f"\ndevice tier: {facts}")
    _throughput(shm)
    print("\noutputs column (generic target, graph step and eager call):")
    print("\n".join(generic_table(shm, generic_kib, opt.iters, "cuda")))


HEADER = (
    "| N | K | tok/exp | plain ms | (i) held | (i) not held | (ii) held | (ii) not held | rows MB "
    "| HBM bound ms | (ii) floor | (ii) held added / bound | eager us plain | eager us rec "
    "| eager us rec, new objects |"
)


def case_cells(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    k: int,
    tokens: int,
    d2d: float,
    shm: Path,
    iters: int,
) -> tuple[list[str], dict]:
    """The cells of one case's row of HEADER after its N, K and tokens, and the device tier's
    facts: the plain step, cases (i) and (ii) held and not held, the HBM bound of (ii)'s rows
    and the eager host times, each against its baseline of the same run."""
    plain = _graph_ms(fn, args, kwargs, iters)
    plain_h = _eager_host_us(fn, args, kwargs, iters)
    res = {}
    with _ScalesOnly():
        for held in (True, False):
            res["i", held] = _recorded(fn, args, kwargs, shm, held, iters)
    for held in (True, False):
        res["ii", held] = _recorded(fn, args, kwargs, shm, held, iters)
    rows = G * tokens
    row_bytes = k + (k // 128) * 4 + 16
    bound = rows * row_bytes / (d2d * 1e9) * 1e3  # those bytes at the plain D2D rate
    added = res["ii", True][0] - plain
    cells = [
        f"{plain:.3f}",
        *(
            f"{res[c, h][0]:.3f} ({res[c, h][0] / plain:.2f}x)"
            for c in ("i", "ii")
            for h in (True, False)
        ),
        f"{rows * row_bytes / 1e6:.1f}",
        f"{bound:.4f}",
        # no recorder that copies those rows before the kernel can step faster than this
        f"{(plain + bound) / plain:.3f}x",
        f"{added / bound:.2f}" if bound else "-",
        f"{plain_h:.1f}",
        f"{res['ii', True][1]:.1f} (+{res['ii', True][1] - plain_h:.1f})",
        f"{res['ii', True][3]:.1f} (+{res['ii', True][3] - plain_h:.1f})",
    ]
    return cells, res["ii", True][2]


def _timed(run: Callable[[], None], nbytes: int) -> float:
    """GB/s of `run` moving `nbytes` (best of ten after a warm-up)."""
    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        run()
    torch.cuda.synchronize()
    return 10 * nbytes / (time.perf_counter() - t0) / 1e9


def _throughput(shm: Path) -> None:
    """Tier copy rates: the snapshot kernel (plain byte ranges; a row gather) against a plain D2D
    copy of the same bytes; the journal's registered pinned memory against a plain pinned buffer."""
    from kdump.bundle.tensors import group_storages
    from kdump.record.flight import gather
    from kdump.record.flight.journal import Journal

    kernels = gather.get_kernel(torch.cuda.current_device())
    fn = kernels.snapshot
    stream = torch.cuda.current_stream().cuda_stream
    record = torch.zeros(64, dtype=torch.uint8, device="cuda")
    ctrl = torch.zeros(16, dtype=torch.uint8, device="cuda")
    # 64 MB: the launch's fixed chain (rule, counters, publication: a few us) still shows;
    # 256 MB: the steady copy rate
    for nbytes in (64 << 20, 256 << 20):
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        p = gather.SnapParams()
        per = nbytes // gather.MAX_COPIES
        for c in range(gather.MAX_COPIES):
            p.copies[c].src = src.data_ptr() + c * per
            p.copies[c].dst = dst.data_ptr() + c * per
            p.copies[c].nbytes = per
        p.n_copies = gather.MAX_COPIES
        p.record, p.ctrl, p.inner, p.alignment = record.data_ptr(), ctrl.data_ptr(), 1, 1
        plain = _timed(lambda: dst.copy_(src), nbytes)  # noqa: B023 (called in this iteration)
        snap = _timed(lambda: gather.launch(fn, p, stream), nbytes)  # noqa: B023
        print(
            f"D2D byte ranges ({nbytes >> 20} MB): snapshot kernel {snap:.0f} GB/s, plain copy "
            f"{plain:.0f} GB/s ({snap / plain:.2f}x)"
        )
    nbytes, src, dst = 64 << 20, src[: 64 << 20], None  # the D2H part below copies 64 MB
    # a row gather of every row of a 36,864 x 4,096 A (what the ring gets at full routing)
    a = torch.randint(0, 255, (36864, 4096), dtype=torch.uint8, device="cuda")
    storages, records = group_storages([a])
    plan = gather.make_plan([a], records, storages, [0], "all", None, 1)
    assert plan is not None
    ring = torch.empty(plan.worst, dtype=torch.uint8, device="cuda")
    g = gather.SnapParams()
    gather.set_plan(g, plan, lambda _: a.data_ptr(), kernels.resident)  # as the recorder does
    g.ring, g.ring_bytes = ring.data_ptr(), plan.worst
    g.record, g.ctrl = record.data_ptr(), ctrl.data_ptr()
    copy_a = torch.empty_like(a)
    plain = _timed(lambda: copy_a.copy_(a), a.numel())
    snap = _timed(lambda: gather.launch(fn, g, stream), a.numel())
    print(
        f"D2D row gather (151 MB of A): snapshot kernel {snap:.0f} GB/s, plain copy "
        f"{plain:.0f} GB/s ({snap / plain:.2f}x)"
    )
    j = Journal.create(shm, slots=2, slot_bytes=nbytes + (1 << 20))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(j._map))
    torch.cuda.cudart().cudaHostRegister(addr, len(j._map), 3)
    view = torch.frombuffer(j._view[j.header_bytes : j.header_bytes + nbytes], dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rate_j = _timed(lambda: view.copy_(src, non_blocking=True), nbytes)
    rate_p = _timed(lambda: pinned.copy_(src, non_blocking=True), nbytes)
    print(
        f"D2H: journal (host tier) {rate_j:.1f} GB/s, plain pinned {rate_p:.1f} GB/s "
        f"({rate_j / rate_p:.2f}x)"
    )
    torch.cuda.cudart().cudaHostUnregister(addr)
    view = None  # the journal's mapping can close once nothing views it
    j.unlink()


if __name__ == "__main__":
    main()
