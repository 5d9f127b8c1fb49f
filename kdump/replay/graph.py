"""Graph replay: the isolation chain for bugs that only show when a captured CUDA graph is replayed
after the routing metadata changed in place.

Steps: (1) eager run, (2) warm-up on a side stream and capture of a torch.cuda.CUDAGraph,
(3) replay with identical inputs, (4) one replay per mutation, each after rewriting inputs and
routing metadata IN PLACE (same pointers, new values): from later calls of the same shape (the
bundle's following calls and `--then` bundles: the production situation) and from the spec's
generator (permuted lengths, all empty, one hot group, maximum skew, ±1 around the alignment,
random draws), (5) the shrinking batch: replays in sequence whose routing keeps fewer and fewer
valid rows per group than at capture, down to none (kdump.replay.graph_routing), (6) changed
addresses: an eager call on new allocations holding other values, then a replay on the captured
inputs that must give what the identical replay gave (kdump.replay.graph_steps). It comes last:
its eager call changes what a library keeps between calls, and every replay after it would
inherit that. Every replay's meaningful output is checked against the reference computed for that
replay's inputs; outputs are poisoned first and the halos around every tensor are checked for stray
writes. A replay that kills the CUDA context ends this process; the parent goes on from the next
step in a fresh one (child.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from kdump.bundle import Call, MaterializedCall, capture_call, load_bundle, save_calls
from kdump.bundle.capture import capture
from kdump.bundle.tensors import clone_layout
from kdump.errors import CannotRunError, UsageError, error_line
from kdump.replay import graph_routing, graph_steps, oracle, procs
from kdump.replay.graph_steps import CHANGED, CHANGED_EAGER, IDENTICAL, SHRINKING
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
    message: str = ""  # what the replay's step says it ran
    metrics: dict[str, int] = field(default_factory=dict)


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


def run_graph(req: Request, progress: Progress, fresh: oracle.Fresh) -> Verdict:
    """The graph replay of `req` (the module docstring's steps); `fresh` runs the fresh-eager
    oracle's processes."""
    s = Session(req, progress)
    require_graphs(s.device)
    mc = s.materialize()
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
    outputs = s.find_outputs(mc, bound, fn, pristine, "graph")
    if outputs is None:
        return s.verdict
    _GraphRun(s, mc, bound, fn, pristine, outputs).run(fresh)
    return s.verdict


class _GraphRun:
    """One call's graph replay chain, after its outputs are known: the steps share the call's
    buffers, its pristine inputs and (after capture) the captured graph."""

    def __init__(
        self,
        s: Session,
        mc: MaterializedCall,
        bound: dict[str, Any],
        fn: Callable[..., Any],
        pristine: list[torch.Tensor],
        outputs: dict[str, int],
    ) -> None:
        self.s, self.mc, self.bound, self.fn = s, mc, bound, fn
        self.pristine, self.outputs = pristine, outputs
        self.allocs = mc.materialized.allocations
        self.skip = set(s.req.options.graph.skip_steps)
        self.save_dir = s.req.options.save_failing
        self.masks = {name: s.spec.meaningful(bound, name) for name in outputs}
        self.baseline: dict[str, torch.Tensor] | None = None
        self.identical: dict[str, torch.Tensor] | None = None  # the identical replay's outputs
        self.graph: Replayable | None = None
        self.fresh = s.req.options.wants_fresh_oracle(s.spec.has_reference()) and bool(outputs)
        self.oracles: dict[str, tuple[Path, dict[str, bool]]] = {}
        self.elapsed = 0.0  # seconds of the latest graph replay

    def phases(self) -> list[Phase]:
        """The recorded phases, then the spec's mutations of the routing."""
        s, opts = self.s, self.s.req.options.graph
        phases = recorded_phases(s)
        for m in s.spec.mutations(self.bound, seed=opts.seed, count=opts.mutations):
            phases.append(Phase(m.name, values=m.values))
        s.note(f"{len(phases)} mutation(s): {', '.join(p.name for p in phases) or 'none'}")
        return phases

    def shrinking(self) -> tuple[list[Phase], str]:
        """The shrinking-batch replays (graph_routing), or why there are none."""
        s = self.s
        arg = graph_routing.find_routing(s.spec, self.bound, s.req.options.graph.routing_arg)
        if isinstance(arg, str):
            return [], arg
        bound = self.bound

        def violations(candidate: torch.Tensor) -> list[str]:
            return [str(v) for v in s.spec.validate({**bound, arg.name: candidate})]

        seq, notes = graph_routing.shrinking_sequence(arg, bound[arg.name], violations)
        for text in notes:
            s.note(text)
        if not seq:
            return [], notes[-1] if notes else "no shorter routing fits the kernel's contract"
        caps = ", ".join(str(st.metrics["rows_per_group"]) for st in seq)
        s.note(f"shrinking batch: {arg.describe()}, {caps} rows per group, in one process")
        restarted = False  # a crash cut the sequence: the rest runs in a fresh process
        phases = []
        for st in seq:
            message = st.message
            if f"graph/replay {st.name}" in self.skip:
                restarted = True
            elif restarted:
                message += "; in a fresh process, after the one that ran the replays before it"
            phases.append(Phase(st.name, values=st.values, message=message, metrics=st.metrics))
        return phases, ""

    def run(self, fresh: oracle.Fresh) -> None:
        phases = self.phases()
        shrinking, no_shrinking = self.shrinking()
        if not self.eager() or not self.capture():
            return
        # (3) identical inputs, (4) mutations, (5) the shrinking batch
        steps = (
            [(IDENTICAL, None)]
            + [(f"graph/replay {i + 1} ({p.name})", p) for i, p in enumerate(phases)]
            + [(f"graph/replay {p.name}", p) for p in shrinking]
        )
        oracle_dir = procs.make_temp("kdump-oracle-") if self.fresh else None
        try:
            for step, phase in steps:
                if step in self.skip:
                    continue
                if not self.replay(step, phase, oracle_dir):
                    return  # the context is gone; the parent continues in a fresh process
            if no_shrinking:
                self.skipped(SHRINKING, no_shrinking)
            # (6) changed addresses
            if not self.changed_addresses(oracle_dir):
                return
            if self.oracles:
                paths = {k: p for k, (p, _) in self.oracles.items()}
                results = oracle.run_fresh(self.s, paths, fresh)
                for step, (_, reproduced) in self.oracles.items():
                    rep = all(reproduced.values()) if reproduced else None
                    oracle.judge(self.s, step, results[step], rep)
        finally:
            if oracle_dir is not None:
                procs.remove_temp(oracle_dir)

    # --- the pieces every step uses -------------------------------------------------------------
    def expected_now(self) -> dict[str, torch.Tensor] | None:
        if not self.s.wants_reference():
            return None
        return {k: v.clone() for k, v in self.s.spec.reference(self.bound).items()}

    def outputs_now(self) -> dict[str, torch.Tensor]:
        return {name: clone_layout(self.mc.tensors[idx]) for name, idx in self.outputs.items()}

    def judge(
        self,
        step: str,
        rerun: Callable[[str], dict[str, torch.Tensor] | None],
        expected: dict[str, torch.Tensor] | None,
        recorded: dict[int, torch.Tensor] | None,
        baseline: dict[str, torch.Tensor] | None,
        against: tuple[str, dict[str, torch.Tensor]] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, bool]] | None:
        """Guards, the halo differential (`rerun` runs the step again with the halos as they
        are), then the comparisons; None when a run of the differential failed. `against`:
        (label, outputs) of an earlier replay this one must reproduce, compared first (its
        finding says why the step exists: graph_steps.STALE_STATE)."""
        s, bound, outputs = self.s, self.bound, self.outputs
        s.check_halos(self.mc, step)
        actual = self.outputs_now()
        diff: Differential | None = Differential()
        if s.placement().halo and outputs:
            diff = differential(s, self.mc, actual, self.masks, rerun, step)
            if diff is None:
                return None
        if against is not None:
            label, earlier = against
            for name, ag in s.compare_runs(
                step, bound, actual, earlier, label, diff.follow
            ).items():
                if not ag.ok:
                    what = graph_steps.BASELINES.get(label, label)
                    s.finding(
                        "mismatch",
                        step,
                        f"{name} differs from {what}: {ag.message}; {graph_steps.STALE_STATE}",
                        {"output": name, "oracle": label, **ag.metrics},
                    )
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

    def eager_again(self, trial: str) -> dict[str, torch.Tensor] | None:
        self.s.restore(self.mc, self.pristine)
        poison_outputs(self.s, self.mc, self.outputs)
        ran = self.s.run_kernel(self.fn, self.mc, trial)
        return self.outputs_now() if ran is not None else None

    # --- (1) eager, (2) capture ------------------------------------------------------------------
    def eager(self) -> bool:
        """The eager run the replays are compared with; False when it failed."""
        s, mc = self.s, self.mc
        expected = self.expected_now()
        poison_outputs(s, mc, self.outputs)
        if "graph/eager" in self.skip:
            s.run_kernel(self.fn, mc, "graph/eager (again)")
            self.baseline = self.outputs_now()
            return True
        dt = s.run_kernel(self.fn, mc, "graph/eager")
        if dt is None:
            return False
        s.step("graph/eager", "ok", "", dt)
        recorded = s.call.materialize_outputs(s.device)
        judged = self.judge("graph/eager", self.eager_again, expected, recorded, None)
        if judged is None:
            return False
        self.baseline = judged[0]
        return True

    def capture(self) -> bool:
        """Warm-up on a side stream, then capture; False when capture failed (a finding)."""
        s, mc = self.s, self.mc
        s.restore(mc, self.pristine)
        s.progress("begin", "graph/capture")
        t0 = time.perf_counter()

        def reset() -> None:
            s.restore(mc, self.pristine)
            poison_outputs(s, mc, self.outputs)

        try:
            self.graph = capture_graph(s, mc, self.fn, reset)
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
            return False
        s.step(
            "graph/capture",
            "ok",
            "warm-up on a side stream, then captured",
            time.perf_counter() - t0,
        )
        return True

    # --- (3), (4) replays ------------------------------------------------------------------------
    def prepare(self, phase: Phase | None) -> None:
        s, bound = self.s, self.bound
        s.restore(self.mc, self.pristine)
        s.pristine = self.pristine  # the bytes before this replay (unwritten outputs are judged by)
        if phase is not None and phase.spans is not None:
            for a, data in zip(self.allocs, phase.spans):
                a.span.copy_(data)
            s.pristine = [d.to(a.span.device) for a, d in zip(self.allocs, phase.spans)]
        if phase is not None and phase.values is not None:
            for name, value in phase.values.items():
                target = bound[name]
                target.copy_(value.to(target.device))

    def replay_graph(self, step: str, crashed: str, timed: bool = True, said: str = "") -> bool:
        """Replay the captured graph once; False (a kernel_error finding, `crashed` says when)
        when it raised. `timed`: a step of its own (synchronised first, its time in
        `self.elapsed`), not a rerun of one. `said`: what the step ran, after the error."""
        assert self.graph is not None
        s = self.s
        if timed:
            sync(s.device)
        s.progress("begin", step)
        t = time.perf_counter()
        try:
            self.graph.replay()
            sync(s.device)
        except Exception as exc:
            text = error_line(exc)
            shown = f"{text} ({said})" if said else text
            s.step(step, "error", shown, time.perf_counter() - t if timed else 0.0)
            s.finding("kernel_error", step, f"{crashed}: {text}")
            return False
        self.elapsed = time.perf_counter() - t
        return True

    def replay(
        self,
        step: str,
        phase: Phase | None,
        oracle_dir: Path | None,
        against: tuple[str, dict[str, torch.Tensor]] | None = None,
        said: str = "",
    ) -> bool:
        """One replay of the captured graph after `phase` rewrote its inputs (None: the captured
        inputs), judged; False when the context is gone (the chain goes on in a fresh process).
        `said`: what the step says it ran (a phase says its own)."""
        s, mc, save_dir = self.s, self.mc, self.save_dir
        self.prepare(phase)
        exp = self.expected_now()
        poison_outputs(s, mc, self.outputs)
        inputs = [a.span.clone() for a in self.allocs] if self.fresh else []
        if save_dir:
            _save_pending(s, mc, save_dir, step, phase)
        said = phase.message if phase is not None else said
        if not self.replay_graph(step, "replay crashed", said=said):
            _keep_pending(save_dir, step)
            return False
        s.step(step, "ok", said, self.elapsed, **(phase.metrics if phase is not None else {}))
        n_before = len(s.verdict.findings)
        recorded = phase.recorded_outputs if phase else None

        def again(trial: str) -> dict[str, torch.Tensor] | None:
            # The graph reads the halos placed before capture: only their bytes change.
            self.prepare(phase)
            poison_outputs(s, mc, self.outputs)
            if not self.replay_graph(trial, "replay crashed with other halo bytes", timed=False):
                return None
            return self.outputs_now()

        baseline = self.baseline if phase is None and against is None else None
        judged = self.judge(step, again, exp, recorded, baseline, against)
        if judged is None:
            _keep_pending(save_dir, step)
            return False
        actual, reproduced = judged
        if step == IDENTICAL:
            self.identical = actual
        if oracle_dir is not None:
            # After the halo differential: saving writes the replay's inputs back into the buffers.
            replayed = {idx: actual[name] for name, idx in self.outputs.items()}
            path = oracle_dir / f"{len(self.oracles)}.kdump"
            self.oracles[step] = (oracle.save_inputs(s, mc, inputs, replayed, path), reproduced)
        if len(s.verdict.findings) > n_before:
            _keep_pending(save_dir, step)
        else:
            _drop_pending(save_dir, step)
        return True

    # --- (6) changed addresses -----------------------------------------------------------------
    def skipped(self, step: str, why: str) -> None:
        """A step that cannot run for this call: one line, never a failure. Reported as begun,
        so a chain restarted after a crash does not say it twice."""
        if step in self.skip:
            return
        self.s.progress("begin", step)
        self.s.step(step, "skipped", why)

    def changed_addresses(self, oracle_dir: Path | None) -> bool:
        """An eager call on new allocations holding other values, then a replay on the captured
        inputs, compared with the identical replay (graph_steps); False when the context is
        gone."""
        s = self.s
        if CHANGED in self.skip or CHANGED_EAGER in self.skip:
            return True
        if not self.outputs:
            self.skipped(CHANGED, "the call writes no output a replay could be compared by")
            return True
        if not any(t.numel() for t in self.mc.tensors):
            self.skipped(CHANGED, "the call has no tensor to place at a new address")
            return True
        s.progress("begin", CHANGED_EAGER)
        try:
            moved = graph_steps.elsewhere(s, self.mc, self.outputs, s.req.options.graph.seed)
        except (torch.cuda.OutOfMemoryError, MemoryError) as exc:
            why = f"a second copy of the call does not fit in memory here ({error_line(exc)})"
            s.step(CHANGED, "skipped", why)
            return True
        expected = (
            {k: v.clone() for k, v in s.spec.reference(moved.bound).items()}
            if s.wants_reference()
            else None
        )
        dt = s.run_kernel(self.fn, moved.mc, CHANGED_EAGER)
        if dt is None:
            return False  # a kernel error: the parent goes on in a fresh process
        s.step(CHANGED_EAGER, "ok", moved.describe(), dt, moved=len(moved.moved))
        if expected is not None:
            got = moved.outputs(self.outputs)
            s.compare_outputs(CHANGED_EAGER, moved.bound, self.outputs, got, expected, {})
        if self.identical is not None:
            against = ("identical replay", self.identical)
        else:  # the identical replay ran in a process that crashed later
            assert self.baseline is not None
            against = ("eager", self.baseline)
        # `moved` stays allocated through the replay: a graph that reads through a pointer the
        # eager call left behind reads that call's values, not freed memory.
        said = "the captured inputs, replayed after the eager call at new addresses"
        ok = self.replay(CHANGED, None, oracle_dir, against, said)
        del moved
        return ok


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
