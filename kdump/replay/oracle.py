"""The fresh-eager oracle: the same inputs run once, eagerly, in a fresh process (fresh
allocations, no state left by earlier calls), compared with the in-sequence result.

The inputs of the replay being judged are saved as a one-call bundle whose recorded output is the
in-sequence result; a fresh process replays it with `ReplayOptions.for_oracle` and its "vs
recorded" step says whether the fresh run agrees. Oracle processes are never reused. The process
is started by the runner the caller hands in (`Fresh`: the replay child protocol of
kdump.replay.child, which runs eager and graph replays and so cannot be imported from here).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kdump.bundle import MaterializedCall, capture_call, save_calls
from kdump.bundle.capture import capture
from kdump.replay.session import Request, Session
from kdump.replay.verdict import Verdict

ORACLE = "fresh eager"

# Runs one request in a fresh process (never a reused one) and returns its verdict.
Fresh = Callable[[Request], Verdict]


@dataclass(frozen=True)
class FreshResult:
    """What a fresh eager run said about one in-sequence result."""

    ran: bool  # False: the oracle process failed (message says how)
    agrees: bool
    differing: int
    max_abs_err: float
    message: str


def save_inputs(
    s: Session,
    mc: MaterializedCall,
    spans: Sequence[torch.Tensor],
    result: dict[int, torch.Tensor],
    path: Path,
) -> Path:
    """Write the call with its storages holding `spans` (the replay's inputs) and `result` (the
    in-sequence outputs, by tensor index) as its recorded output. Leaves the spans as given."""
    for a, data in zip(mc.materialized.allocations, spans):
        a.span.copy_(data)
    call = capture_call(
        s.call.target,
        mc.args,
        mc.kwargs,
        called_as=s.call.called_as,
        names=s.call.names,
        meta={**s.call.meta, "backend": s.backend.name, "oracle": ORACLE},
    )
    idx = sorted(result)
    call.outputs = capture([result[i] for i in idx])
    call.inplace = [(i, k) for k, i in enumerate(idx)]
    save_calls(path, [call], env=s.bundle.env)
    return path


def run_fresh(s: Session, bundles: dict[str, Path], fresh: Fresh) -> dict[str, FreshResult]:
    """Replay each oracle bundle in its own fresh process (`fresh`), in parallel where cores
    allow."""
    opts = replace(s.req.options.for_oracle(), device=str(s.device))
    names = list(bundles)

    def one(name: str) -> FreshResult:
        return read_fresh(fresh(Request(str(bundles[name]), 0, opts)))

    workers = max(1, min(len(names), (os.cpu_count() or 1)))
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(one, names)))


def read_fresh(v: Verdict) -> FreshResult:
    """The oracle child's judgement of the in-sequence result."""
    # An over-read the oracle's own halo differential names is the in-sequence replay's to
    # report (its fresh run read the same poison): the comparison still stands.
    bad = [
        f
        for f in v.findings
        if f.kind != "mismatch" and f.details.get("evidence") != "halo differential"
    ]
    if bad:
        return FreshResult(False, False, 0, 0.0, f"the fresh eager run failed: {bad[0].message}")
    steps = [st for st in v.steps if st.name.endswith(" vs recorded")]
    if not steps:
        return FreshResult(False, False, 0, 0.0, "the fresh eager run compared nothing")
    agrees = all(st.status == "ok" for st in steps)
    differing = sum(int(st.metrics.get("differing", 0) or 0) for st in steps)
    err = max(float(st.metrics.get("max_abs_err", 0.0) or 0.0) for st in steps)
    return FreshResult(True, agrees, differing, err, "")


def story(fresh: FreshResult, reproduced: bool | None) -> tuple[bool, str]:
    """(ok, the sentence a user needs) for one in-sequence result against its fresh oracle and,
    where there is one, the recorded output (`reproduced`)."""
    if not fresh.ran:
        return True, f"no fresh eager verdict: {fresh.message}"
    if fresh.agrees:
        return True, "matches a fresh eager run of the same inputs"
    diff = f"{fresh.differing} elements, max error {fresh.max_abs_err:.3g}"
    if reproduced is None:
        tail = ""
    elif reproduced:
        tail = " and matches what production recorded"
    else:
        tail = " and from what production recorded"
    return False, (
        f"differs from a fresh eager run of the same inputs ({diff}){tail}: the kernel keeps "
        "state across calls (capture-unsafe)"
    )


def judge(s: Session, step: str, fresh: FreshResult, reproduced: bool | None) -> None:
    """Add the "vs fresh eager" step (and a mismatch finding when it disagrees)."""
    ok, text = story(fresh, reproduced)
    s.step(f"{step} vs {ORACLE}", "ok" if ok else "fail", text)
    if not ok:
        s.finding(
            "mismatch",
            step,
            f"{step.split('/', 1)[-1]} {text}",
            {"oracle": ORACLE, "differing": fresh.differing, "max_abs_err": fresh.max_abs_err},
        )
    elif not fresh.ran:
        s.note(text)
