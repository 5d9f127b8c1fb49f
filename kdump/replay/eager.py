"""Eager replay: materialise with exact layout, poison outputs, run, compare with the reference,
the recorded output and itself (bitwise over --repeat runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kdump.bundle import MaterializedCall
from kdump.replay import halo
from kdump.replay.session import Progress, Request, Session, poison_outputs
from kdump.replay.verdict import Verdict


def run_eager(req: Request, progress: Progress) -> Verdict:
    s = Session(req, progress)
    mc = s.materialize()
    bound = s.spec.bind(mc.args, mc.kwargs)
    s.step("materialize", "ok", f"{len(mc.tensors)} tensors on {s.device}")
    if not s.check_contract(bound):
        return s.verdict
    s.apply_library_settings()
    outputs = s.output_indices(mc, bound)
    expected = None
    if s.wants_reference():
        progress("begin", "eager/reference")
        expected = {k: v.clone() for k, v in s.spec.reference(bound).items()}
    recorded = s.call.materialize_outputs(s.device)
    fn = s.backend.resolve(s.spec, s.call.target)

    pristine = s.snapshot(mc)
    first: dict[str, torch.Tensor] = {}
    for r in range(1, max(1, req.repeat) + 1):
        step = f"eager/run {r}"
        if r > 1:
            s.restore(mc, pristine)  # every run sees the recorded inputs, at the same addresses
        poisoned = poison_outputs(s, mc, outputs)
        seconds = s.run_kernel(fn, mc, step)
        if seconds is None:
            return s.verdict
        s.step(step, "ok", f"poisoned {', '.join(poisoned) or 'nothing'}", seconds)
        s.check_halos(mc, step)
        actual = {name: mc.tensors[idx].clone() for name, idx in outputs.items()}
        if r == 1:
            first = actual
            s.compare_outputs(step, bound, outputs, actual, expected, recorded)
            nan_seen = _nan_count(s, mc, outputs, bound) if s.placement().halo else 0
            if nan_seen:
                attribute_overreads(s, mc, fn, outputs, bound, pristine, nan_seen)
            continue
        s.compare_bitwise(
            step, bound, actual, first, "run 1", "nondeterminism", "is not deterministic"
        )
    if not outputs:
        s.note("no outputs to compare: the spec names none and the bundle recorded none")
    return s.verdict


def _nan_count(s: Session, mc: MaterializedCall, outputs: dict[str, int], bound: dict) -> int:
    """NaNs in the meaningful elements of the outputs."""
    n = 0
    for name, idx in outputs.items():
        t = mc.tensors[idx]
        if not t.dtype.is_floating_point:
            continue
        bad = torch.isnan(t)
        mask = s.spec.meaningful(bound, name)
        if mask is not None:
            bad &= mask.to(t.device).bool().expand(t.shape)
        n += int(bad.sum())
    return n


def attribute_overreads(
    s: Session,
    mc: MaterializedCall,
    fn: Callable[..., Any],
    outputs: dict[str, int],
    bound: dict,
    pristine: list[torch.Tensor],
    nan_seen: int,
) -> None:
    """Find which input's halo NaNs in the output come from. First a run with every halo zeroed:
    if the NaNs stay, they are not from the halos (unwritten elements, or the kernel's own).
    Otherwise one run per halo side with only that side poisoned names the tensor that was read
    out of bounds (which memcheck may miss: TMA loads)."""
    allocs = mc.materialized.allocations

    def run(step: str) -> int | None:
        s.restore(mc, pristine)
        poison_outputs(s, mc, outputs)
        if s.run_kernel(fn, mc, step) is None:
            return None
        return _nan_count(s, mc, outputs, bound)

    halo.neutralize(allocs)
    baseline = run("eager/halo neutral")
    if baseline is None or baseline >= nan_seen:
        halo.fill(allocs, s.call.tensors)
        s.guards = halo.snapshot(allocs)
        return
    out_storages = {s.call.tensors[i].storage for i in outputs.values()}
    for a in allocs:
        if a.storage in out_storages:
            continue
        names = [n for n, rec in zip(mc.tensor_names, s.call.tensors) if rec.storage == a.storage]
        for side in ("before", "after"):
            step = f"eager/halo {'/'.join(names)} {side}"
            halo.neutralize(allocs)
            halo.poison_side(a, side)
            n = run(step)
            if n is None:
                return
            if n > baseline:
                where = "past the end of" if side == "after" else "before the start of"
                msg = (
                    f"out-of-bounds read {where} {' / '.join(names)}: NaNs from its poisoned "
                    f"halo reached {n - baseline} output element(s)"
                )
                s.step(step, "fail", msg)
                s.finding("memory", "eager/run 1", msg, {"tensors": names, "side": side})
    halo.fill(allocs, s.call.tensors)
    s.guards = halo.snapshot(allocs)
