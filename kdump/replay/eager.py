"""Eager replay: materialise with exact layout, poison outputs, run, compare with the oracles (the
reference, the recorded output, a fresh eager run) and with itself over --repeat runs.

A call with earlier calls of the same target and layout in its bundle is replayed in sequence
when the fresh-eager oracle applies: the earlier calls run first in the same buffers (as in
production), and the call's result is then compared with a fresh process's run of its inputs.
"""

from __future__ import annotations

import torch

from kdump.bundle import Call, MaterializedCall
from kdump.bundle.tensors import clone_layout
from kdump.replay import oracle, procs, triton_oracle
from kdump.replay.compare import _expand_mask, distinct_results
from kdump.replay.overreads import Differential, differential, report
from kdump.replay.session import Progress, Request, Session, poison_outputs
from kdump.replay.verdict import Verdict


def earlier_calls(s: Session) -> list[Call]:
    """Earlier calls of the same target whose inputs fit this call's buffers."""
    from kdump.replay.graph import same_layout

    return [
        c
        for c in s.bundle.calls
        if c.index < s.call.index and c.target == s.call.target and same_layout(s.call, c) is None
    ]


def run_eager(req: Request, progress: Progress, fresh: oracle.Fresh) -> Verdict:
    """The eager replay of `req`; `fresh` runs the fresh-eager oracle's process."""
    s = Session(req, progress)
    mc = s.materialize()
    bound = s.spec.bind(mc.args, mc.kwargs)
    s.step("materialize", "ok", f"{len(mc.tensors)} tensors on {s.device}")
    if not s.check_contract(bound):
        return s.verdict
    s.apply_library_settings()
    expected = None
    if s.wants_reference():
        progress("begin", "eager/reference")
        expected = {k: v.clone() for k, v in s.spec.reference(bound).items()}
    recorded = s.call.materialize_outputs(s.device)
    fn = s.backend.resolve(s.spec, s.call.target)

    pristine = s.snapshot(mc)
    prelude = earlier_calls(s) if req.options.wants_fresh_oracle(s.spec.has_reference()) else []
    for c in prelude:
        step = f"eager/call {c.index} (in sequence)"
        for j, (a, st) in enumerate(zip(mc.materialized.allocations, c.storages)):
            a.span.copy_(c._bundle.span_bytes(st, j).to(a.span.device))
        if s.run_kernel(fn, mc, step) is None:
            return s.verdict
        s.step(step, "ok", "earlier call of the same target, in the same buffers")
    # After the earlier calls: the first run of this call is the one production made after them.
    found = s.find_outputs(mc, bound, fn, pristine, "eager")
    if found is None:
        return s.verdict
    outputs = found
    runs: list[dict[str, torch.Tensor]] = []
    poisoned: list[str] = []
    reproduced: dict[str, bool] = {}
    explained: dict[str, torch.Tensor] = {}  # output elements read from a halo

    def run_once(trial: str) -> dict[str, torch.Tensor] | None:
        s.restore(mc, pristine)
        poison_outputs(s, mc, outputs)
        if s.run_kernel(fn, mc, trial) is None:
            return None
        return {name: clone_layout(mc.tensors[idx]) for name, idx in outputs.items()}

    for r in range(1, max(1, req.repeat) + 1):
        step = f"eager/run {r}"
        s.restore(mc, pristine)  # every run sees the recorded inputs, at the same addresses
        poisoned = poison_outputs(s, mc, outputs)
        seconds = s.run_kernel(fn, mc, step)
        if r == 1:
            s.note_recorded_exception(raised=seconds is None)
        if seconds is None:
            return s.verdict
        s.step(step, "ok", f"poisoned {', '.join(poisoned) or 'nothing'}", seconds)
        s.check_halos(mc, step)
        actual = {name: clone_layout(mc.tensors[idx]) for name, idx in outputs.items()}
        runs.append(actual)
        if r == 1:
            diff: Differential | None = Differential()
            if s.placement().halo and outputs:
                masks = {name: s.spec.meaningful(bound, name) for name in outputs}
                diff = differential(s, mc, actual, masks, run_once, "eager")
                if diff is None:
                    return s.verdict  # a run with the second poison failed (its finding says how)
                explained = diff.follow
            symptoms: list[str] = []
            reproduced = s.compare_outputs(
                step, bound, outputs, actual, expected, recorded, explained, symptoms
            )
            s.compare_returned(step)
            report(s, diff, step, symptoms)
            continue
        s.compare_runs(step, bound, actual, runs[0], "run 1", explained)
    _judge_repeats(s, bound, runs, explained)
    if wants_interpreter(s) and runs and outputs:
        triton_oracle.check(
            s,
            "eager/run 1",
            outputs,
            poisoned,
            runs[0],
            explained,
            budget=s.req.options.interpreter_budget,
        )
    if prelude and runs and outputs:
        _fresh_oracle(s, mc, outputs, pristine, runs[0], reproduced, fresh)
    if not outputs and not s.call.has_returned:
        s.note("no outputs to compare: the call wrote none of its tensor arguments")
    return s.verdict


def wants_interpreter(s: Session) -> bool:
    """The interpreter oracle judges a Triton kernel run compiled on a GPU (on the CPU the
    interpreter is the replay itself); an oracle process (--oracle off) runs none."""
    return s.kernel is not None and s.device.type == "cuda" and s.req.options.oracle != "off"


def _judge_repeats(
    s: Session,
    bound: dict,
    runs: list[dict[str, torch.Tensor]],
    explained: dict[str, torch.Tensor],
) -> None:
    """Repeats that disagree beyond tolerance: nondeterminism, counted in distinct results.
    Elements read from a halo (`explained`) are the over-read's, never nondeterminism."""
    if len(runs) < 2:
        return
    for name in runs[0]:
        mask = s.spec.meaningful(bound, name)
        if name in explained:
            mask = _expand_mask(mask, runs[0][name]) & ~explained[name]
        results = [r[name] for r in runs]
        k = distinct_results(results, mask, bitwise=s.req.options.bitwise)
        if k < 2:
            continue
        first_bad = next(
            st
            for st in s.verdict.steps
            if st.name.startswith("eager/run ")
            and st.name.endswith(" vs run 1")
            and st.status == "fail"
            and st.message.startswith(f"{name}:")
        )
        s.finding(
            "nondeterminism",
            "eager/repeat",
            f"{name} is nondeterministic: {k} distinct results in {len(runs)} runs "
            f"({first_bad.message.split(': ', 1)[-1]})",
            {"output": name, "distinct": k, "runs": len(runs), **first_bad.metrics},
        )


def _fresh_oracle(
    s: Session,
    mc: MaterializedCall,
    outputs: dict[str, int],
    pristine: list[torch.Tensor],
    result: dict[str, torch.Tensor],
    reproduced: dict[str, bool],
    fresh: oracle.Fresh,
) -> None:
    with procs.temp_folder("kdump-oracle-") as tmp:
        path = oracle.save_inputs(
            s, mc, pristine, {idx: result[n] for n, idx in outputs.items()}, tmp / "o.kdump"
        )
        result = oracle.run_fresh(s, {"eager/run 1": path}, fresh)["eager/run 1"]
    rep = all(reproduced.values()) if reproduced else None
    oracle.judge(s, "eager/run 1", result, rep)
