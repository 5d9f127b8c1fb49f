"""Where the flight recorder's host time goes on an eager GPU call: cProfile of N recorded calls
of the grouped GEMM (G=288, N=512, K=4096, 32 tokens per expert), and the wall time of each phase
(first call: journal and device tier; the recorded calls; leaving the recording: its flush).
The unhooked call, the recorded call (the same tensor objects, and new objects over the same
memory) and the floors of any device-side recorder are also measured interleaved, in rounds
(medians), so that the host's load reaches each alike.

    python lab/profile_recorder.py [--calls 200] [--backend deep_gemm|packaged] [--top 40]
        [--rounds 5]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import pstats
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _timing import host_us, new_step_objects

import kdump
from kdump.kernels import registry
from kdump.record.config import RingConfig

TARGET = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
# the floor wrapper with the driver calls the recorder makes per eager call
_RECORDERS_DRIVER_CALLS = "+ a launch before the call and a stream write after it (ctypes)"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--backend", choices=("deep_gemm", "packaged"), default="deep_gemm")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds of the interleaved measurement (unhooked, recorded, floors in turn)",
    )
    opt = p.parse_args()
    if opt.backend == "packaged":
        api = importlib.import_module("kdump.kernels.sm120.api")
        sys.modules["deep_gemm"] = types.ModuleType("deep_gemm")
        sys.modules["deep_gemm"].m_grouped_fp8_gemm_nt_contiguous = (  # type: ignore[attr-defined]
            api.m_grouped_fp8_gemm_nt_contiguous
        )
    module = importlib.import_module("deep_gemm")
    spec = registry.spec_for(TARGET)
    args, kwargs = spec.generate(
        seed=1,
        device="cuda",
        scale_format="fp32",
        num_groups=288,
        n=512,
        k=4096,
        expected_m=opt.tokens,
    )
    labels = args[3]
    rows = torch.arange(labels.numel(), device=labels.device)
    labels.copy_(torch.where(rows % 128 < opt.tokens, rows // 128, -1).to(torch.int32))
    fn = unhooked = module.m_grouped_fp8_gemm_nt_contiguous
    for _ in range(3):
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    plain = host_us(fn, args, kwargs, opt.calls)
    torch.cuda.synchronize()
    shm = Path(tempfile.mkdtemp(prefix="kdump-prof-", dir="/dev/shm"))
    ring = RingConfig(slots=64, slot_bytes=1 << 20, journal_dir=shm, device_bytes=1 << 30)
    phases = {}
    t = time.perf_counter()
    with kdump.recording("deep_gemm", out=shm / "out", mode="ring", ring=ring) as rec:
        fn = module.m_grouped_fp8_gemm_nt_contiguous
        fn(*args, **kwargs)
        torch.cuda.synchronize()
        phases["first call (journal, device tier)"] = time.perf_counter() - t
        cuda = rec.recorder._cuda
        if cuda is not None and cuda.tier is not None:
            cuda.tier.held = True
        for _ in range(5):
            fn(*args, **kwargs)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        host = host_us(fn, args, kwargs, opt.calls, prof)
        bare_rec = host_us(fn, args, kwargs, opt.calls)
        torch.cuda.synchronize()
        no_memo = _without_memo(fn, args, kwargs, opt.calls)
        torch.cuda.synchronize()
        split = _split(fn, args, kwargs, opt.calls)
        torch.cuda.synchronize()
        before = _as_before(rec.recorder, fn, args, kwargs, opt.calls)
        torch.cuda.synchronize()
        try:
            mixed = _interleaved(unhooked, fn, args, kwargs, max(opt.calls // 4, 40), opt.rounds)
        except Exception as exc:  # a side measurement: report, keep the rest
            mixed = {f"not measured ({type(exc).__name__}: {exc})": float("nan")}
        t = time.perf_counter()
    phases["leaving the recording (flush)"] = time.perf_counter() - t
    base = mixed.get("unhooked", float("nan"))
    print(
        f"interleaved ({opt.rounds} rounds, each entry {max(opt.calls // 4, 40)} calls a round, "
        "medians), host us per call and added to the unhooked call: "
        + ", ".join(
            f"{k} {v:.1f}" + ("" if k == "unhooked" else f" (+{v - base:.1f})")
            for k, v in mixed.items()
        )
    )
    floor = mixed.get(f"floor: {_RECORDERS_DRIVER_CALLS}", float("nan"))
    print(
        "added host us per recorded call (interleaved medians): "
        f"{mixed.get('recorded', float('nan')) - base:.1f} with the same tensor objects, "
        f"{mixed.get('recorded, new objects', float('nan')) - base:.1f} with new ones "
        f"(goal <= 25); the floor of its driver calls ({_RECORDERS_DRIVER_CALLS}): "
        f"{floor - base:.1f}"
    )
    print(
        "one after another (the host's load may move between them), host us per call: "
        f"unhooked {plain:.1f}, recorded {bare_rec:.1f} (under cProfile {host:.1f}), the device "
        f"enqueue computed every call (no per-slot memo) {no_memo:.1f}, each call's host copies "
        "issued on their own (batch of 1: the driver calls per call of the earlier code) and no "
        f"lanes (the repeat key every call) {before:.1f}"
    )
    total = pstats.Stats(prof).total_calls  # type: ignore[attr-defined]
    print(f"Python function calls per recorded call (cProfile): {total / opt.calls:.0f}")
    print(
        "per-call profile, us (wall clocks around each part; the timers add ~0.3 us each): "
        + ", ".join(f"{k} {v:.1f}" for k, v in split.items())
    )
    for k, v in phases.items():
        print(f"{k}: {v:.2f} s")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(opt.top)
        print(s.getvalue())


def _floor_fns(fn: Any) -> dict[str, Any]:
    """What any recorder of an eager call pays at least, as wrappers of the unhooked `fn`: a
    Python wrapper that binds the arguments by name (how a hook sees them), and one kernel launch
    and one event record through ctypes on libcuda (the fewest driver calls a device-side
    snapshot whose slot is reused can make: its copy kernel, and the event that frees the slot);
    and two launches around the call (a snapshot before it and a done marker after it, which
    says exactly whether the kernel returned), and a launch before with a stream write of the
    done marker after (what the recorder enqueues per eager call, besides its batched host
    copies). Without libcuda only the first."""
    import ctypes
    import inspect

    from kdump.record.flight import cudrv, gather

    sig = inspect.Signature(
        [
            inspect.Parameter(f"a{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
            for i in range(8)
        ]
        + [inspect.Parameter("kw", inspect.Parameter.VAR_KEYWORD)]
    )

    def wrapper(*a: Any, **k: Any) -> Any:
        sig.bind(*a, **k)
        return fn(*a, **k)

    out: dict[str, Any] = {"Python wrapper binding the arguments": wrapper}
    drv = cudrv.driver()
    if drv is None:
        return out
    mark = gather.get_kernel(torch.cuda.current_device()).mark
    fh = cudrv.handle(mark)
    cell = torch.zeros(2, dtype=torch.int64, device="cuda")
    ptrs = (ctypes.c_uint64 * 2)(cell.data_ptr(), cell.data_ptr() + 8)
    kargs = (ctypes.c_void_p * 2)(ctypes.addressof(ptrs), ctypes.addressof(ptrs) + 8)
    from cuda.bindings import driver as cb

    _err, ev = cb.cuEventCreate(cb.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    evh = cudrv.handle(ev)
    word = torch.zeros(1, dtype=torch.int64, device="cuda")  # the stream write's target
    kept = (cell, ptrs, ev, word)  # alive as long as the wrappers are

    def launched(*a: Any, **k: Any) -> Any:
        sig.bind(*a, **k)
        stream = torch.cuda.current_stream().cuda_stream
        drv.launch(fh, 1, 1, kargs, stream, "kd_mark")
        r = fn(*a, **k)
        drv.record(evh, stream)
        return r

    def marked(*a: Any, **k: Any) -> Any:
        sig.bind(*a, **k)
        stream = torch.cuda.current_stream().cuda_stream
        drv.launch(fh, 1, 1, kargs, stream, "kd_mark")
        r = fn(*a, **k)
        drv.launch(fh, 1, 1, kargs, stream, "kd_mark")
        return r

    done = word.data_ptr()

    def written(*a: Any, **k: Any) -> Any:
        sig.bind(*a, **k)
        stream = torch.cuda.current_stream().cuda_stream
        drv.launch(fh, 1, 1, kargs, stream, "kd_mark")
        r = fn(*a, **k)
        drv.write64(stream, done, 1)
        return r

    for f in (launched, marked, written):
        f.kept = kept  # type: ignore[attr-defined]
    out["+ one launch and one event record (ctypes)"] = launched
    # a snapshot before the call and an exact done marker after it
    out["+ two launches, before and after the call (ctypes)"] = marked
    # the recorder's eager calls today: the done marker as a stream write, no second launch
    out[_RECORDERS_DRIVER_CALLS] = written
    return out


def _interleaved(
    unhooked: Any, hooked: Any, args: tuple, kwargs: dict, calls: int, rounds: int
) -> dict[str, float]:
    """Median host us per call over `rounds` rounds in which the unhooked call, the recorded
    call (same objects, then new objects over the same memory) and each floor wrapper of the
    unhooked call take `calls` calls in turn: a change of the host's load reaches them alike."""
    entries: dict[str, tuple[Any, Any]] = {
        "unhooked": (unhooked, None),
        "recorded": (hooked, None),
        # a serving step: A, its scales, D and the labels new objects over the same blocks,
        # the weights (B and its scales) the same objects
        "recorded, new objects": (hooked, new_step_objects),
    }
    for name, f in _floor_fns(unhooked).items():
        entries[f"floor: {name}"] = (f, None)
    for f, fresh in entries.values():  # warm every path once
        for _ in range(3):
            f(*(fresh(args) if fresh else args), **kwargs)

    def measure(f: Any, fresh: Any) -> Any:
        return lambda: host_us(f, args, kwargs, calls, fresh=fresh)

    return interleaved({name: measure(f, fresh) for name, (f, fresh) in entries.items()}, rounds)


def _as_before(recorder: Any, fn: Any, args: tuple, kwargs: dict, calls: int) -> float:
    """Host us per recorded call with batches of one host copy and lanes that never match."""
    from kdump.record.flight import recorder as ring_mod

    cuda = recorder._cuda
    batch, tensors = cuda.batch, ring_mod.Lane.tensors
    cuda.drain()
    cuda.batch = 1
    ring_mod.Lane.tensors = lambda self, a, k: None  # type: ignore[method-assign]
    try:
        for _ in range(3):
            fn(*args, **kwargs)
        return host_us(fn, args, kwargs, calls)
    finally:
        cuda.batch = batch
        ring_mod.Lane.tensors = tensors  # type: ignore[method-assign]


def _without_memo(fn: Any, args: tuple, kwargs: dict, calls: int) -> float:
    """Host us per recorded call with `DeviceCopies.copy` given no memo (an eager repeat's
    enqueue computed in full every call, as before the memo)."""
    from kdump.record.flight import devcopy

    copy0 = devcopy.DeviceCopies.copy

    def copy(self: Any, *a: Any, memo: Any = None, **k: Any) -> Any:
        return copy0(self, *a, **k)

    devcopy.DeviceCopies.copy = copy  # type: ignore[method-assign]
    try:
        return host_us(fn, args, kwargs, calls)
    finally:
        devcopy.DeviceCopies.copy = copy0  # type: ignore[method-assign]


def _split(fn: Any, args: tuple, kwargs: dict, calls: int) -> dict[str, float]:
    """Host us per recorded call in its parts: the repeat decision (`probe`, the lane's check,
    `repeat_key` where the lane did not take the call), the repeat
    path's bookkeeping (`_again` less the device enqueue), the device enqueue (`DeviceCopies.
    copy` and the done marker after the call: its driver calls), and the rest (the hook, the
    trigger, the call itself)."""
    from kdump.record.flight import devcopy
    from kdump.record.flight import recorder as ring_mod

    acc = dict.fromkeys(("repeat decision", "bookkeeping", "device enqueue", "total"), 0.0)
    clock = time.perf_counter
    key0, again0 = ring_mod.repeat_key, ring_mod.RingRecorder._again
    copy0 = devcopy.DeviceCopies.copy

    def charged(f: Any, part: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t = clock()
            try:
                return f(*a, **k)
            finally:
                acc[part] += clock() - t

        return timed

    def again(*a: Any, **k: Any) -> Any:
        t = clock()
        e = acc["device enqueue"]
        try:
            return again0(*a, **k)
        finally:
            acc["bookkeeping"] += clock() - t - (acc["device enqueue"] - e)

    def copy(*a: Any, **k: Any) -> Any:
        t = clock()
        after = copy0(*a, **k)
        acc["device enqueue"] += clock() - t

        def timed() -> None:
            t = clock()
            after()
            acc["device enqueue"] += clock() - t

        return timed

    ring_mod.repeat_key = charged(key0, "repeat decision")
    ring_mod.RingRecorder._again = again  # type: ignore[method-assign]
    devcopy.DeviceCopies.copy = copy
    probe0, lane0 = ring_mod.probe, ring_mod.Lane.tensors
    ring_mod.probe = charged(probe0, "repeat decision")
    ring_mod.Lane.tensors = charged(lane0, "repeat decision")  # type: ignore[method-assign]
    try:
        acc["total"] = host_us(fn, args, kwargs, calls) * calls / 1e6
    finally:
        ring_mod.repeat_key, ring_mod.RingRecorder._again = key0, again0
        ring_mod.probe, ring_mod.Lane.tensors = probe0, lane0  # type: ignore[method-assign]
        devcopy.DeviceCopies.copy = copy0
    out = {k: v / calls * 1e6 for k, v in acc.items()}
    parts = out["repeat decision"] + out["bookkeeping"] + out["device enqueue"]
    out["rest (hook, trigger, call)"] = out.pop("total") - parts
    return out


def interleaved(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The median of `rounds` results of each measurement, the measurements taken in turn within
    each round (in the dict's order), so that a change of the host's load between rounds reaches
    every one of them alike, where one after the other it would favour some."""
    got: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            got[name].append(measure())
    return {name: statistics.median(values) for name, values in got.items()}


if __name__ == "__main__":
    main()
