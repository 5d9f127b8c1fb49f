"""The flight recorder's host time per recorded eager call on CPU (ring mode, no device tier).

A stand-in `deep_gemm` module whose `m_grouped_fp8_gemm_nt_contiguous` does nothing is recorded
with arguments of the GPU profile's shape (lab/profile_recorder.py: G=288, N=512, K=4096, 32
tokens per expert), made on the CPU. What the slot gets there: the routing labels and the small
scales are copied by the host, the weights go once to the static region, A and the output keep
their layouts only (too big for a 1 MiB slot); torch runs one intra-op thread. Unhooked and
recorded calls alternate in batches of the same run; each batch pair gives a ratio (the machine
may be loaded: medians).

Recorded batches alternate between the exact-repeat path on and off (off: every call takes the
full path, as before it existed), in the same process, and with A, its scales, D and the labels
new tensor objects over the same memory at every call (a serving loop's step; the weights the
same objects). `--copies off` leaves out the host copies
and the payload checksum (the slot is committed with its header checksum only, as on the GPU
path, where the device copies): what remains is the recorder's bookkeeping.

The outputs column: a generic target (no spec: `fn(x, out)` that does nothing, x and out of
`--out-kib` each) recorded with its outputs kept after the call (the default for a target
without a reference spec: out is copied into the slot again after the call, then the `out`
marker) and with `--outputs none`, in alternating sessions of the same process; the stand-in
DeepGEMM keeps none by default (its spec has a reference), so its rows above are unchanged.

    python lab/bench_ring_host.py [--calls 300] [--rounds 7] [--k 4096] [--groups 288]
        [--copies host|off] [--out-kib 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _machine, _timing
from _machine import cpu_model
from _timing import new_step_objects

import kdump
from kdump.kernels import registry
from kdump.record.config import RingConfig
from kdump.record.flight import recorder as ring_module

TARGET = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"


def _stand_in() -> types.ModuleType:
    mod = types.ModuleType("deep_gemm")

    def m_grouped_fp8_gemm_nt_contiguous(*args: object, **kwargs: object) -> None:
        return None

    mod.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous  # type: ignore[attr-defined]
    return mod


GENERIC = "kdump_bench_generic:kernel"


def _generic_module() -> types.ModuleType:
    mod = types.ModuleType("kdump_bench_generic")

    def kernel(x: torch.Tensor, out: torch.Tensor) -> None:
        return None  # what it would write: out (the recorder copies it after the call)

    mod.kernel = kernel  # type: ignore[attr-defined]
    return mod


def outputs_column(
    shm: Path, calls: int, rounds: int, out_kib: int
) -> tuple[list[float], list[float], list[float], int]:
    """Host µs per call of a generic target: (unhooked, recorded with --outputs none, recorded
    with its outputs kept (default), bundles' slots that hold outputs out of those checked).
    Sessions alternate per round, each warmed up outside the timing."""
    from kdump.format.journal import SlotState
    from kdump.record.flight.journal_reader import read_journal

    saved = sys.modules.get("kdump_bench_generic")
    module = sys.modules["kdump_bench_generic"] = _generic_module()
    n = max(1, out_kib * 1024 // 4)
    x, out = torch.randn(n), torch.zeros(n)
    argsets = [(x, out)] * calls
    plain_fn = module.kernel
    plain: list[float] = []
    timed: dict[str, list[float]] = {"none": [], "default": []}
    held = 0
    ring = RingConfig(slots=64, slot_bytes=1 << 20, journal_dir=shm, device_bytes=0)
    try:
        for _ in range(rounds):
            plain.append(_per_call_us(plain_fn, argsets, {}))
            for outputs in ("none", "default"):
                with kdump.recording(
                    GENERIC, out=shm / "out-generic", mode="ring", ring=ring, outputs=outputs
                ) as session:
                    hooked = module.kernel
                    assert hooked is not plain_fn, "the generic stand-in was not hooked"
                    for _ in range(20):
                        hooked(x, out)
                    timed[outputs].append(_per_call_us(hooked, argsets, {}))
                    if outputs == "default":
                        slots = read_journal(session.recorder.journal.path).having(
                            SlotState.COMPLETE
                        )
                        held += sum(s.outputs_held for s in slots)
                    # Leaving would write every slot as a bundle: not what this measures.
                    session.recorder.flush = lambda: None  # type: ignore[method-assign]
    finally:
        if saved is not None:
            sys.modules["kdump_bench_generic"] = saved
        else:
            sys.modules.pop("kdump_bench_generic", None)
    return plain, timed["none"], timed["default"], held


def _per_call_us(fn: object, argsets: list[tuple], kwargs: dict) -> float:
    """Host µs per call of `fn` over the argument tuples `argsets`, one call each."""
    t0 = time.perf_counter()
    for args in argsets:
        fn(*args, **kwargs)  # type: ignore[operator]
    return (time.perf_counter() - t0) / len(argsets) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--groups", type=int, default=288)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--copies", choices=("host", "off"), default="host")
    p.add_argument("--profile", type=int, default=0, help="print cProfile's top N of one batch")
    p.add_argument("--out-kib", type=int, default=64, help="the outputs column's x and out")
    opt = p.parse_args()
    # One intra-op thread: on a shared machine torch's thread pool turns a 150 KB copy into
    # milliseconds of waiting, which would hide the recorder's own time.
    torch.set_num_threads(1)
    saved = sys.modules.get("deep_gemm")
    module = sys.modules["deep_gemm"] = _stand_in()
    spec = registry.spec_for(TARGET)
    args, kwargs = spec.generate(
        seed=1,
        device="cpu",
        scale_format="fp32",
        num_groups=opt.groups,
        n=opt.n,
        k=opt.k,
        expected_m=opt.tokens,
    )
    args = tuple(args)
    labels = args[3]
    rows = torch.arange(labels.numel())
    labels.copy_(torch.where(rows % 128 < opt.tokens, rows // 128, -1).to(torch.int32))
    plain_fn = module.m_grouped_fp8_gemm_nt_contiguous
    same = [args] * opt.calls  # the same tensor objects every call
    shm = Path(tempfile.mkdtemp(prefix="kdump-bench-ring-", dir="/dev/shm"))
    ring = RingConfig(slots=64, slot_bytes=1 << 20, journal_dir=shm, device_bytes=0)
    plain: list[float] = []
    rec: list[float] = []
    full: list[float] = []
    fresh: list[float] = []
    repeat_key, probe = ring_module.repeat_key, ring_module.probe
    try:
        with kdump.recording("deep_gemm", out=shm / "out", mode="ring", ring=ring) as session:
            hooked = module.m_grouped_fp8_gemm_nt_contiguous
            assert hooked is not plain_fn, "the stand-in was not hooked"
            recorder = session.recorder
            if opt.copies == "off":

                def header_only(slot: object, views: object, outputs: object = ()) -> object:
                    slot.commit(device=True)  # type: ignore[attr-defined]
                    return slot.finish  # type: ignore[attr-defined]

                recorder._host_copy = header_only
            for _ in range(20):  # journal, static region, signature caches
                hooked(*args, **kwargs)
            for _ in range(opt.rounds):
                plain.append(_per_call_us(plain_fn, same, kwargs))
                rec.append(_per_call_us(hooked, same, kwargs))
                # made outside the timing: A, its scales, D and the labels new objects
                renewed = [new_step_objects(args) for _ in range(opt.calls)]
                fresh.append(_per_call_us(hooked, renewed, kwargs))
                del renewed
                # the full path for every call: no lane (its probe finds none) and no repeat key
                ring_module.repeat_key = ring_module.probe = lambda *a: None
                try:
                    full.append(_per_call_us(hooked, same, kwargs))
                finally:
                    ring_module.repeat_key, ring_module.probe = repeat_key, probe
            fast = recorder.fast_calls
            if opt.profile:
                prof = cProfile.Profile()
                prof.enable()
                _per_call_us(hooked, same, kwargs)
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(opt.profile)
                print(out.getvalue())
            errors = session.recorder.errors
        generic = outputs_column(shm, opt.calls, opt.rounds, opt.out_kib)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if saved is not None:
            sys.modules["deep_gemm"] = saved
        else:
            sys.modules.pop("deep_gemm", None)
    ratios = [r / p_ for p_, r in zip(plain, rec)]
    gains = [f / r for f, r in zip(full, rec)]
    print(
        f"G={opt.groups} N={opt.n} K={opt.k} tokens/expert={opt.tokens}, copies {opt.copies}, "
        f"{opt.rounds} rounds of {opt.calls} calls, load {os.getloadavg()[0]:.2f}, "
        f"{cpu_model()}, python {platform.python_version()}, torch {torch.__version__}"
    )
    print(
        f"host us per call: unhooked {statistics.median(plain):.2f}, recorded "
        f"{statistics.median(rec):.1f} (min {min(rec):.1f}), new objects for A, its scales, D "
        f"and the labels every call {statistics.median(fresh):.1f} (min {min(fresh):.1f}), "
        f"full path every call {statistics.median(full):.1f} (min {min(full):.1f}); ratio to "
        f"unhooked {statistics.median(ratios):.0f}x, full / repeat path "
        f"{statistics.median(gains):.2f}x (repeat-path calls {fast}, recorder errors {errors})"
    )
    g_plain, g_none, g_kept, held = generic
    print(
        f"outputs column, generic target fn(x, out), {opt.out_kib} KiB each, host us per call: "
        f"unhooked {statistics.median(g_plain):.2f}, recorded --outputs none "
        f"{statistics.median(g_none):.1f} (min {min(g_none):.1f}), outputs kept (default) "
        f"{statistics.median(g_kept):.1f} (min {min(g_kept):.1f}): +"
        f"{statistics.median(g_kept) - statistics.median(g_none):.1f} us for the copy after "
        f"the call (slots checked holding outputs: {held})"
    )


if __name__ == "__main__":
    main()
