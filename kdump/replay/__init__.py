"""Offline replay of recorded calls: eager, graph, sanitizer.

`replay()` runs each (bundle, call) in a child process (kdump.replay.child: a crash becomes a
verdict) and returns one Verdict per call.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from kdump.bundle import iter_bundles, load_bundle
from kdump.errors import BundleError, UsageError
from kdump.kernels.registry import check_target
from kdump.replay.options import ReplayOptions, from_keywords
from kdump.replay.session import Request
from kdump.replay.verdict import Finding, Step, Verdict

T = TypeVar("T")


def replay(
    paths: Iterable[str | Path],
    options: ReplayOptions | None = None,
    *,
    calls: Sequence[int] | None = None,
    on_done: Callable[[Verdict, int], None] | None = None,
    **keywords: Any,
) -> list[Verdict]:
    """Replay every selected call of `paths`; one Verdict per call (mode "all": one combined).
    `on_done(verdict, replays)` runs as each replay ends (progress display; `replays` is how many
    there are), from the thread that ran it.

    `options` is a ReplayOptions; keyword arguments (mode=, backend=, repeat=, tools=,
    mutations=, then=, ...: replay.options.KEYWORDS) override it."""
    opts = from_keywords(options, **keywords)
    paths = [str(p) for p in paths]
    opts.refuse_inapplicable()
    if opts.then:
        check_then(paths, opts.then)
    if opts.mode == "sanitizer":
        from kdump.replay.sanitizer import find_sanitizer

        binary = str(find_sanitizer(opts.sanitizer.binary))
        opts = replace(opts, sanitizer=replace(opts.sanitizer, binary=binary))
    work: list[tuple[str, int]] = []
    unreadable: list[Verdict] = []
    for path in iter_bundles(paths):
        try:
            bundle = load_bundle(path)  # validated in the parent: a bad bundle is exit 2
        except BundleError as exc:
            if len(paths) == 1 and not Path(paths[0]).is_dir():
                raise  # the one bundle asked for: a usage error
            unreadable.append(_unreadable(str(path), opts.mode, exc))
            continue
        indices = [c.index for c in bundle.calls] if calls is None else list(calls)
        if opts.mode in ("graph", "all") and calls is None:
            indices = _capture_calls(bundle)
        for i in indices:
            # Trust is decided here, before any child starts (the child checks again).
            check_target(bundle.call(i).target, opts.allow_targets)
            work.append((str(path), i))

    from kdump.replay.child import WorkerPool

    # Eager replays of many bundles share worker processes (kdump.replay.child.WorkerPool).
    workers = WorkerPool() if opts.isolate and opts.mode == "eager" else None

    def one(item: tuple[str, int], gpu: int | None) -> Verdict:
        from kdump.replay.child import run_in_child, run_in_process

        path, i = item
        env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        base = Request(path, i, opts)

        def run(m: str) -> Verdict:
            req = replace(base, options=opts.for_child(m))
            if not opts.isolate:
                return run_in_process(req)
            return run_in_child(req, opts.timeout, env, workers)

        if opts.mode in ("eager", "graph"):
            v = run(opts.mode)
            if opts.escalate:
                v = _escalate(v, base, env)
        elif opts.mode == "sanitizer":
            v = _sanitize(base, env)
        else:
            v = _all(base, run, env)
        if not v.target:
            v.target = load_bundle(path).call(i).target
        if on_done is not None:
            on_done(v, len(work))
        return v

    gpus = _gpu_count() if opts.jobs > 1 else 0
    try:
        if opts.jobs > 1 and len(work) > 1:
            verdicts = run_on_slots(work, opts.jobs, gpus, one)
        else:
            verdicts = [one(item, None) for item in work]
    finally:
        if workers is not None:
            workers.close()
    verdicts = unreadable + verdicts
    if opts.save_failing:
        # A replay that died before it could report leaves its inputs pending: they reproduce.
        for p in Path(opts.save_failing).glob("*.kdump.pending"):
            p.rename(p.with_suffix(""))
    return verdicts


def _unreadable(path: str, mode: str, exc: BundleError) -> Verdict:
    v = Verdict(path, -1, "", mode)
    v.findings.append(Finding("bundle", "load", str(exc), {"bundle_error": exc.kind.value}))
    return v


def run_on_slots(
    items: Sequence[T], jobs: int, gpus: int, fn: Callable[[T, int | None], Verdict]
) -> list[Verdict]:
    """fn(item, gpu) for every item, `jobs` at a time, results in the items' order. A work queue:
    each of the `jobs` slots is bound to a GPU (round robin over `gpus`; None without GPUs) and
    takes the next item when its previous one ends, so no GPU runs two replays while another
    idles."""
    free: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    for k in range(jobs):
        free.put(k % gpus if gpus else None)

    def on_free_slot(item: T) -> Verdict:
        gpu = free.get()
        try:
            return fn(item, gpu)
        finally:
            free.put(gpu)

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(on_free_slot, items))


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _sanitize(base: Request, env: dict[str, str] | None) -> Verdict:
    from kdump.replay.sanitizer import find_sanitizer, run_sanitizer

    plan = base.options.sanitizer
    binary = find_sanitizer(plan.binary)
    combined: Verdict | None = None
    for m in ["eager"] + (["graph"] if plan.graph else []):
        for tool in plan.tools:
            req = replace(base, options=base.options.for_child(m))
            v = run_sanitizer(req, tool, binary, env)
            combined = _merge(combined, v, f"sanitizer/{tool}" + ("/graph" if m == "graph" else ""))
    assert combined is not None  # ReplayOptions has at least one tool
    combined.mode = "sanitizer"
    return combined


def _escalate(v: Verdict, base: Request, env: dict[str, str] | None) -> Verdict:
    """A call where production died of a GPU fault whose plain replay found no fault: the same
    chain under compute-sanitizer memcheck (kdump.replay.escalate)."""
    from kdump.errors import CannotRunError
    from kdump.replay.escalate import production_fault, sanitizer_command, wants_escalation
    from kdump.replay.sanitizer import find_sanitizer

    fault = production_fault(load_bundle(base.bundle).call(base.call).meta)
    if fault is None or not wants_escalation([f.kind for f in v.findings]):
        return v
    graph = base.mode == "graph"
    said = f"production crashed at this call ({fault}) and the plain replay did not"
    try:
        if not v.device.startswith("cuda"):
            raise CannotRunError("the replay ran without a CUDA GPU")
        binary = find_sanitizer(base.options.sanitizer.binary)
    except CannotRunError as exc:
        command = sanitizer_command(
            base.bundle, base.call, graph, base.options.allow_targets, base.options.paths
        )
        v.notes.append(f"{said}; compute-sanitizer cannot run here ({exc}): run `{command}`")
        v.findings.append(
            Finding(
                "cannot_run",
                "sanitizer",
                f"{said}; memcheck, which would look for the stray access, cannot run here: "
                f"run `{command}` on a machine with a GPU and compute-sanitizer",
                {"production_fault": fault, "command": command},
            )
        )
        return v
    plan = replace(base.options.sanitizer, binary=str(binary), tools=("memcheck",), graph=graph)
    checked = _sanitize(replace(base, options=replace(base.options, sanitizer=plan)), env)
    found = [f for f in checked.findings if f.kind != "cannot_run"]
    v.notes.append(
        f"{said}: ran it under compute-sanitizer memcheck with the caching allocator off"
    )
    merged = _merge(v, checked, "sanitizer")
    for f in found:
        f.message = f"{f.message} (production crashed here: {fault})"
        f.details["production_fault"] = fault
    if not found:
        merged.notes.append(
            "memcheck found nothing either: the fault may need the production process' state "
            "(earlier calls, other allocations) or another GPU"
        )
    return merged


def _all(base: Request, run: Callable[[str], Verdict], env: dict[str, str] | None) -> Verdict:
    """eager, graph (on a GPU) and sanitizer (when found) in one verdict."""
    from kdump.errors import CannotRunError
    from kdump.replay.sanitizer import find_sanitizer

    combined = _merge(None, run("eager"), "eager")
    if combined.device.startswith("cuda"):
        combined = _merge(combined, run("graph"), "graph")
        try:
            binary = find_sanitizer(base.options.sanitizer.binary)
        except CannotRunError as exc:
            combined.notes.append(f"sanitizer mode could not run: {exc}")
            if combined.clean:
                combined.findings.append(Finding("cannot_run", "sanitizer", str(exc)))
        else:
            plan = replace(base.options.sanitizer, binary=str(binary), graph=False)
            sanitized = _sanitize(replace(base, options=replace(base.options, sanitizer=plan)), env)
            combined = _merge(combined, sanitized, "sanitizer")
    else:
        skipped = "graph and sanitizer modes could not run: no CUDA GPU here"
        combined.notes.append(skipped)
        if combined.clean:  # never a silent clean; a reproduced failure keeps its own code
            combined.findings.append(Finding("cannot_run", "all", skipped))
    combined.mode = "all"
    return combined


def _merge(into: Verdict | None, v: Verdict, prefix: str) -> Verdict:
    """Fold `v` into `into`, prefixing the step names (of steps and of findings) that do not
    already carry a mode."""
    mode = prefix.split("/")[0] + "/"
    for s in v.steps:
        if not s.name.startswith(mode):
            s.name = f"{prefix}/{s.name}"
    for f in v.findings:
        if not f.step.startswith(mode):
            f.step = f"{prefix}/{f.step}"
    if into is None:
        return v
    into.steps.extend(v.steps)
    into.findings.extend(v.findings)
    into.notes.extend(n for n in v.notes if n not in into.notes)
    return into


def _capture_calls(bundle) -> list[int]:
    """In graph mode a call whose layout equals an earlier call's is replayed into that call's
    graph (the production sequence), not captured on its own."""
    from kdump.replay.graph import same_layout

    firsts: list = []
    for c in bundle.calls:
        if not any(f.target == c.target and same_layout(f, c) is None for f in firsts):
            firsts.append(c)
    return [c.index for c in firsts]


def check_then(paths: Sequence[str], then: Sequence[str]) -> None:
    """--then bundles must match the replayed call's shapes, strides and dtypes (else exit 2)."""
    from kdump.replay.graph import parse_then, same_layout

    for spec in then:
        other_path, idx = parse_then(spec)
        other = load_bundle(other_path).call(idx)
        for path in iter_bundles(paths):
            for c in load_bundle(path).calls:
                if c.target == other.target and same_layout(c, other) is None:
                    break
            else:
                raise UsageError(
                    f"--then {spec}: no call in {path} has the same target, shapes, strides and "
                    "dtypes"
                )


__all__ = ["Finding", "ReplayOptions", "Request", "Step", "Verdict", "replay"]
