"""Eager replay: materialise with exact layout, poison outputs, run, compare with the reference,
the recorded output and itself (bitwise over --repeat runs)."""

from __future__ import annotations

import torch

from kdump.replayer.compare import bitwise_diff
from kdump.replayer.session import Progress, Request, Session, poison_outputs
from kdump.replayer.verdict import Verdict


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
            continue
        for name in outputs:
            diff = bitwise_diff(actual[name], first[name], s.spec.meaningful(bound, name))
            if diff is None:
                s.step(f"{step} vs run 1", "ok", f"{name}: bit-identical")
            else:
                s.step(f"{step} vs run 1", "fail", f"{name}: {diff['message']}")
                s.finding(
                    "nondeterminism",
                    step,
                    f"{name} is not deterministic: {diff['message']}",
                    {"output": name, **diff},
                )
    if not outputs:
        s.note("no outputs to compare: the spec names none and the bundle recorded none")
    return s.verdict
