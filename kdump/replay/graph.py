"""Graph replay: the isolation chain for bugs that only show when a captured CUDA graph is replayed
after the routing metadata changed in place.

Steps: (1) eager run, (2) warm-up on a side stream and capture of a torch.cuda.CUDAGraph,
(3) replay with identical inputs, (4) one replay per mutation, each after rewriting inputs and
routing metadata IN PLACE (same pointers, new values): from later calls of the same shape (the
bundle's following calls and `--then` bundles: the production situation) and from the spec's
generator (permuted lengths, all empty, one hot group, maximum skew, ±1 around the alignment,
random draws). Every replay's meaningful output is checked against the reference computed for that
replay's inputs; outputs are poisoned first and the halos around every tensor are checked for stray
writes. A replay that kills the CUDA context ends this process; the parent goes on from the next
step in a fresh one (child.py).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kdump.bundle import Call, MaterializedCall, capture_call, load_bundle, save_calls
from kdump.bundle.tensors import capture, clone_layout
from kdump.errors import CannotRunError, UsageError, error_line
from kdump.replay import oracle
from kdump.replay.overreads import Differential, differential, report
from kdump.replay.session import Progress, Request, Session, poison_outputs
from kdump.replay.verdict import Verdict


@dataclass
class Phase:
    """One graph replay: a name and how to rewrite the inputs before it."""

    name: str
    spans: list[torch.Tensor] | None = None  # whole storage spans (from another recorded call)
    values: dict[str, torch.Tensor] | None = None  # parameter name -> new value (synthesised)
    recorded_outputs: dict[int, torch.Tensor] | None = None


def same_layout(a: Call, b: Call) -> str | None:
    """None when `b` can be replayed into `a`'s buffers; else what differs."""
    if len(a.tensors) != len(b.tensors) or len(a.storages) != len(b.storages):
        return (
            f"{len(b.tensors)} tensors in {len(b.storages)} storages vs {len(a.tensors)} in "
            f"{len(a.storages)}"
        )
    names = a.tensor_names
    for i, (x, y) in enumerate(zip(a.tensors, b.tensors)):
        if (x.dtype, x.shape, x.stride, x.storage) != (y.dtype, y.shape, y.stride, y.storage):
            return (
                f"{names[i]}: {y.dtype} {list(y.shape)} stride {list(y.stride)} vs "
                f"{x.dtype} {list(x.shape)} stride {list(x.stride)}"
            )
        rel_x = x.storage_offset * x.itemsize - a.storages[x.storage].span_start
        rel_y = y.storage_offset * y.itemsize - b.storages[y.storage].span_start
        if rel_x != rel_y:
            return f"{names[i]}: different offset inside its storage"
    for j, (x, y) in enumerate(zip(a.storages, b.storages)):
        if x.span_nbytes != y.span_nbytes:
            return f"storage {j}: {y.span_nbytes} bytes vs {x.span_nbytes}"
    return None


def parse_then(spec: str) -> tuple[str, int]:
    """'OTHER.kdump[:call]' -> (path, call index)."""
    path, sep, idx = spec.rpartition(":")
    if sep and idx.isdigit() and path:
        return path, int(idx)
    return spec, 0


def recorded_phases(s: Session) -> list[Phase]:
    """Later calls of the same layout in this bundle, then `--then` calls, as phases."""
    sources: list[tuple[str, Call]] = []
    for c in s.bundle.calls:
        if c.index > s.call.index and c.target == s.call.target and same_layout(s.call, c) is None:
            sources.append((f"call {c.index}", c))
    for spec in s.req.options.then:
        path, idx = parse_then(spec)
        other = load_bundle(path).call(idx)
        why = same_layout(s.call, other)
        if why:
            raise UsageError(f"--then {spec}: not the same shapes, strides and dtypes ({why})")
        sources.append((f"{Path(path).name}:{idx}", other))
    phases = []
    for label, c in sources:
        # Storages not held as a blob (sparse, synthetic, missing, by-reference) are re-created.
        spans = [c._bundle.span_bytes(st, j) for j, st in enumerate(c.storages)]
        outs = c.materialize_outputs(s.device) if c.has_outputs else None
        phases.append(Phase(f"recorded {label}", spans=spans, recorded_outputs=outs))
    return phases


def run_graph(req: Request, progress: Progress) -> Verdict:
    s = Session(req, progress)
    require_graphs(s.device)
    mc = s.materialize()
    allocs = mc.materialized.allocations
    bound = s.spec.bind(mc.args, mc.kwargs)
    s.step(
        "materialize",
        "ok",
        f"{len(mc.tensors)} tensors on {s.device}, {s.placement().halo}-byte halos",
    )
    if not s.check_contract(bound):
        return s.verdict
    s.apply_library_settings()
    fn = s.backend.resolve(s.spec, s.call.target)
    pristine = s.snapshot(mc)
    found = s.find_outputs(mc, bound, fn, pristine, "graph")
    if found is None:
        return s.verdict
    outputs = found
    skip = set(req.options.graph.skip_steps)
    save_dir = req.options.save_failing

    phases = recorded_phases(s)
    mutations = req.options.graph.mutations
    seed = req.options.graph.seed
    for m in s.spec.mutations(bound, seed=seed, count=mutations):
        phases.append(Phase(m.name, values=m.values))
    s.note(f"{len(phases)} mutation(s): {', '.join(p.name for p in phases) or 'none'}")

    def expected_now() -> dict[str, torch.Tensor] | None:
        if not s.wants_reference():
            return None
        return {k: v.clone() for k, v in s.spec.reference(bound).items()}

    masks = {name: s.spec.meaningful(bound, name) for name in outputs}

    def outputs_now() -> dict[str, torch.Tensor]:
        return {name: clone_layout(mc.tensors[idx]) for name, idx in outputs.items()}

    def judge(
        step: str,
        rerun: Callable[[str], dict[str, torch.Tensor] | None],
        expected: dict[str, torch.Tensor] | None,
        recorded: dict[int, torch.Tensor] | None,
        baseline: dict[str, torch.Tensor] | None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, bool]] | None:
        """Guards, the halo differential (`rerun` runs the step again with the halos as they
        are), then the comparisons; None when a run of the differential failed."""
        s.check_halos(mc, step)
        actual = outputs_now()
        diff: Differential | None = Differential()
        if s.placement().halo and outputs:
            diff = differential(s, mc, actual, masks, rerun, step)
            if diff is None:
                return None
        symptoms: list[str] = []
        reproduced = s.compare_outputs(
            step, bound, outputs, actual, expected, recorded or {}, diff.follow, symptoms
        )
        if expected is None and baseline is not None:
            for name, ag in s.compare_runs(
                step, bound, actual, baseline, "eager", diff.follow
            ).items():
                if not ag.ok:
                    s.finding("mismatch", step, f"{name} differs from the eager run: {ag.message}")
        report(s, diff, step, symptoms)
        return actual, reproduced

    def eager_again(trial: str) -> dict[str, torch.Tensor] | None:
        s.restore(mc, pristine)
        poison_outputs(s, mc, outputs)
        return outputs_now() if s.run_kernel(fn, mc, trial) is not None else None

    # (1) eager
    expected = expected_now()
    poison_outputs(s, mc, outputs)
    if "graph/eager" not in skip:
        dt = s.run_kernel(fn, mc, "graph/eager")
        if dt is None:
            return s.verdict
        s.step("graph/eager", "ok", "", dt)
        judged = judge(
            "graph/eager", eager_again, expected, s.call.materialize_outputs(s.device), None
        )
        if judged is None:
            return s.verdict
        baseline = judged[0]
    else:
        s.run_kernel(fn, mc, "graph/eager (again)")
        baseline = outputs_now()

    # (2) warm-up on a side stream, then capture
    s.restore(mc, pristine)
    s.progress("begin", "graph/capture")
    t0 = time.perf_counter()
    try:
        graph = capture_graph(
            s, mc, fn, lambda: (s.restore(mc, pristine), poison_outputs(s, mc, outputs))
        )
    except Exception as exc:
        text = error_line(exc)
        if s.backend.name == "reference":
            # The torch reference synchronises with the host (data-dependent shapes): it was
            # never meant to run inside a graph. Not a finding about the kernel.
            raise CannotRunError(
                "the torch reference backend cannot be captured in a CUDA graph; replay with "
                "--mode eager, or choose a kernel backend for graph mode"
            )
        s.step("graph/capture", "error", text, time.perf_counter() - t0)
        s.finding("kernel_error", "graph/capture", f"capture failed: {text}")
        return s.verdict
    s.step(
        "graph/capture", "ok", "warm-up on a side stream, then captured", time.perf_counter() - t0
    )

    def prepare(phase: Phase | None) -> None:
        s.restore(mc, pristine)
        s.pristine = pristine  # the bytes before this replay (unwritten outputs are judged by)
        if phase is not None and phase.spans is not None:
            for a, data in zip(allocs, phase.spans):
                a.span.copy_(data)
            s.pristine = [d.to(a.span.device) for a, d in zip(allocs, phase.spans)]
        if phase is not None and phase.values is not None:
            for name, value in phase.values.items():
                target = bound[name]
                target.copy_(value.to(target.device))

    fresh = req.options.wants_fresh_oracle(s.spec.has_reference()) and bool(outputs)
    oracle_dir = tempfile.TemporaryDirectory(prefix="kdump-oracle-") if fresh else None
    oracles: dict[str, tuple[Path, dict[str, bool]]] = {}

    def replay(step: str, phase: Phase | None) -> bool:
        prepare(phase)
        exp = expected_now()
        poison_outputs(s, mc, outputs)
        inputs = [a.span.clone() for a in allocs] if fresh else []
        if save_dir:
            _save_pending(s, mc, save_dir, step, phase)
        sync(s.device)
        s.progress("begin", step)
        t = time.perf_counter()
        try:
            graph.replay()
            sync(s.device)
        except Exception as exc:
            text = error_line(exc)
            s.step(step, "error", text, time.perf_counter() - t)
            s.finding("kernel_error", step, f"replay crashed: {text}")
            _keep_pending(save_dir, step)
            return False
        s.step(step, "ok", "", time.perf_counter() - t)
        n_before = len(s.verdict.findings)
        recorded = phase.recorded_outputs if phase else None

        def again(trial: str) -> dict[str, torch.Tensor] | None:
            # The graph reads the halos placed before capture: only their bytes change.
            prepare(phase)
            poison_outputs(s, mc, outputs)
            s.progress("begin", trial)
            try:
                graph.replay()
                sync(s.device)
            except Exception as exc:
                text = error_line(exc)
                s.step(trial, "error", text)
                s.finding("kernel_error", trial, f"replay crashed with other halo bytes: {text}")
                return None
            return outputs_now()

        judged = judge(step, again, exp, recorded, baseline if phase is None else None)
        if judged is None:
            _keep_pending(save_dir, step)
            return False
        actual, reproduced = judged
        replayed = {idx: actual[name] for name, idx in outputs.items()} if fresh else {}
        if oracle_dir is not None:
            # After the halo differential: saving writes the replay's inputs back into the buffers.
            path = Path(oracle_dir.name, f"{len(oracles)}.kdump")
            oracles[step] = (oracle.save_inputs(s, mc, inputs, replayed, path), reproduced)
        if len(s.verdict.findings) > n_before:
            _keep_pending(save_dir, step)
        else:
            _drop_pending(save_dir, step)
        return True

    # (3) identical inputs, (4) mutations
    steps = [("graph/replay identical", None)] + [
        (f"graph/replay {i + 1} ({p.name})", p) for i, p in enumerate(phases)
    ]
    try:
        for step, phase in steps:
            if step in skip:
                continue
            if not replay(step, phase):
                return s.verdict  # the context is gone; the parent continues in a fresh process
        if oracles:
            results = oracle.run_fresh(s, {k: p for k, (p, _) in oracles.items()})
            for step, (_, reproduced) in oracles.items():
                rep = all(reproduced.values()) if reproduced else None
                oracle.judge(s, step, results[step], rep)
    finally:
        if oracle_dir is not None:
            oracle_dir.cleanup()
    return s.verdict


class Replayable(Protocol):
    def replay(self) -> None: ...


def require_graphs(device: torch.device) -> None:
    if device.type != "cuda":
        raise CannotRunError("graph mode needs a CUDA GPU; on this machine use --mode eager")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture_graph(
    s: Session, mc: MaterializedCall, fn: Callable[..., Any], reset: Callable[[], object]
) -> Replayable:
    """Warm up on a side stream, `reset()` the buffers, capture one call in a CUDA graph. Every
    buffer (halos included) was allocated before: the graph reads them at every replay."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(s.device)
    side.wait_stream(torch.cuda.current_stream(s.device))
    with torch.cuda.stream(side):
        fn(*mc.args, **mc.kwargs)
    torch.cuda.current_stream(s.device).wait_stream(side)
    torch.cuda.synchronize(s.device)
    reset()
    with torch.cuda.graph(graph):
        fn(*mc.args, **mc.kwargs)
    torch.cuda.synchronize(s.device)
    return graph


def _pending_path(save_dir: str, step: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in step)
    return Path(save_dir, f"failing-{safe}.kdump.pending")


def _save_pending(
    s: Session, mc: MaterializedCall, save_dir: str, step: str, phase: Phase | None
) -> None:
    """Write the capture call and this replay's inputs before replaying: after a crash nothing
    can be read from the GPU any more. Outputs recorded for the replay's inputs go with it, so
    targets without a reference still show the mismatch when the bundle is replayed."""
    first = capture_call(
        s.call.target,
        [*_cpu_args(s)],
        dict(s.call.kwargs),
        called_as=s.call.called_as,
        names=s.call.names,
        # its tensors are CPU copies of what ran on s.device: say where it ran
        meta={**s.call.meta, "graph_role": "capture", "device": str(s.device)},
    )
    then = capture_call(
        s.call.target,
        mc.args,
        mc.kwargs,
        called_as=s.call.called_as,
        names=s.call.names,
        meta={"graph_role": f"replay: {step}"},
    )
    recorded = s.call.materialize_outputs("cpu")
    if recorded:  # the capture call's outputs tell which tensors are outputs (generic targets)
        idx = sorted(recorded)
        first.outputs = capture([recorded[i] for i in idx])
        first.inplace = [(i, k) for k, i in enumerate(idx)]
    if phase is not None and phase.recorded_outputs:
        idx = sorted(phase.recorded_outputs)
        then.outputs = capture([phase.recorded_outputs[i] for i in idx])
        then.inplace = [(i, k) for k, i in enumerate(idx)]
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    save_calls(
        _pending_path(save_dir, step),
        [first, then],
        env=s.bundle.env,
        info={"reproduces": "kdump replay THIS --mode graph", "failing_step": step},
    )


def _cpu_args(s: Session) -> list[Any]:
    return list(s.call.args)


def _keep_pending(save_dir: str | None, step: str) -> None:
    if save_dir:
        p = _pending_path(save_dir, step)
        if p.exists():
            p.rename(p.with_suffix(""))


def _drop_pending(save_dir: str | None, step: str) -> None:
    if save_dir:
        _pending_path(save_dir, step).unlink(missing_ok=True)
