"""Out-of-bounds reads named by the halo pass, on any target and in eager and graph mode.

When an output holds NaN where neither the recorded output nor the reference has one, the call is
re-run with every halo neutralised (zero): NaNs that stay are not from the halos. Otherwise one
run per input storage and side with only that halo poisoned names the tensor read out of bounds
(which memcheck may miss: TMA loads), and runs with only the nearest bytes poisoned bound how far.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kdump.bundle import MaterializedCall
from kdump.replay import halo
from kdump.replay.session import Session

# Nearest-bytes poisoned when bounding the distance of an over-read.
_REACH = (64, 256, 1024, 4096, 16384, 65536)


def _human(n: int) -> str:
    return f"{n // 1024} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} bytes"


def unexplained_nans(
    s: Session,
    mc: MaterializedCall,
    outputs: dict[str, int],
    bound: dict,
    known: dict[str, torch.Tensor],
) -> int:
    """NaNs in the meaningful output elements where no oracle (`known`: name -> tensor the
    recorded output or the reference) has a NaN."""
    n = 0
    for name, idx in outputs.items():
        t = mc.tensors[idx]
        if not t.dtype.is_floating_point:
            continue
        bad = torch.isnan(t)
        mask = s.spec.meaningful(bound, name)
        if mask is not None:
            bad &= mask.to(t.device).bool().expand(t.shape)
        for other in known.get(name, ()):
            if other.shape == t.shape:
                bad &= ~torch.isnan(other.to(t.device).float())
        n += int(bad.sum())
    return n


def attribute_overreads(
    s: Session,
    mc: MaterializedCall,
    run: Callable[[str], bool],
    count: Callable[[], int],
    outputs: dict[str, int],
    prefix: str,
    blame: str,
    nan_seen: int,
) -> bool:
    """Run the halo pass; `run(step)` restores the inputs, poisons the outputs and runs the call
    once (False: it failed), `count()` counts unexplained NaNs. Returns True when a tensor was
    named (a memory finding on step `blame`)."""
    allocs = mc.materialized.allocations
    found = False

    def trial(step: str) -> int | None:
        return count() if run(step) else None

    try:
        halo.neutralize(allocs)
        baseline = trial(f"{prefix}/halo neutral")
        if baseline is None or baseline >= nan_seen:
            return False
        out_storages = {s.call.tensors[i].storage for i in outputs.values()}
        for a in allocs:
            if a.storage in out_storages:
                continue
            names = [
                n for n, rec in zip(mc.tensor_names, s.call.tensors) if rec.storage == a.storage
            ]
            for side in ("before", "after"):
                step = f"{prefix}/halo {'/'.join(names)} {side}"
                halo.neutralize(allocs)
                halo.poison_side(a, side)
                n = trial(step)
                if n is None:
                    return found
                if n <= baseline:
                    continue
                reach = halo.halo_bytes(a, side)
                for k in _REACH:
                    if k >= reach:
                        break
                    halo.neutralize(allocs)
                    halo.poison_near(a, side, k)
                    m = trial(f"{step} {k} bytes")
                    if m is not None and m > baseline:
                        reach = k
                        break
                where = "past the end of" if side == "after" else "before the start of"
                who = " / ".join(names)
                msg = (
                    f"reads {where} {who} (by up to {_human(reach)}): NaN from its poisoned halo "
                    f"reached {n - baseline} output element(s) (evidence: the halo pass)"
                )
                s.step(step, "fail", msg)
                s.finding(
                    "memory",
                    blame,
                    msg,
                    {"tensors": names, "side": side, "by_up_to": reach, "evidence": "halo pass"},
                )
                found = True
        return found
    finally:
        halo.fill(allocs, s.call.tensors)
        s.guards = halo.snapshot(allocs)
