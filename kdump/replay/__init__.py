"""Offline replay of recorded calls: eager, graph, sanitizer.

`replay()` runs each (bundle, call) in a child process (a crash becomes a verdict) and returns
one Verdict per call.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from kdump.bundle import iter_bundles, load_bundle
from kdump.errors import UsageError
from kdump.replay.isolate import run_in_child, run_in_process
from kdump.replay.session import Request
from kdump.replay.verdict import Finding, Step, Verdict

MODES = ("eager", "graph", "sanitizer", "all")


def replay(
    paths: Iterable[str | Path],
    *,
    mode: str = "eager",
    backend: str = "auto",
    device: str = "auto",
    calls: Sequence[int] | None = None,
    repeat: int = 2,
    force: bool = False,
    timeout: float | None = 600.0,
    isolate: bool = True,
    options: dict | None = None,
    tools: Sequence[str] = ("memcheck",),
    sanitize_graph: bool = False,
    sanitizer: str | None = None,
    kernel_filter: str | None = None,
    jobs: int = 1,
) -> list[Verdict]:
    """Replay every selected call of `paths`; one Verdict per call (mode "all": one combined)."""
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    options = dict(options or {})
    if options.get("then"):
        check_then([str(p) for p in paths], options["then"])
    plan = SanitizerPlan(tuple(tools), sanitize_graph, sanitizer, timeout, kernel_filter)
    if mode == "sanitizer":
        from kdump.replay.sanitizer import find_sanitizer

        plan = replace(plan, binary=str(find_sanitizer(sanitizer)))
    work: list[tuple[str, int]] = []
    for path in iter_bundles(paths):
        bundle = load_bundle(path)  # validate in the parent: a bad bundle is exit 2, not a crash
        indices = [c.index for c in bundle.calls] if calls is None else list(calls)
        if mode in ("graph", "all") and calls is None:
            indices = _capture_calls(bundle)
        for i in indices:
            bundle.call(i)
            work.append((str(path), i))

    def one(item: tuple[str, int], gpu: int | None) -> Verdict:
        path, i = item
        env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
        base = Request(path, i, mode, backend, device, repeat, force, options)

        def run(m: str) -> Verdict:
            req = replace(base, mode=m)
            return run_in_child(req, timeout, env) if isolate else run_in_process(req)

        if mode in ("eager", "graph"):
            v = run(mode)
        elif mode == "sanitizer":
            v = _sanitize(base, plan, env)
        else:
            v = _all(base, plan, run, env)
        if not v.target:
            v.target = load_bundle(path).call(i).target
        return v

    gpus = _gpu_count() if jobs > 1 else 0
    if jobs > 1 and len(work) > 1:
        with ThreadPoolExecutor(jobs) as pool:
            futures = [
                pool.submit(one, item, (k % gpus) if gpus else None) for k, item in enumerate(work)
            ]
            verdicts = [f.result() for f in futures]
    else:
        verdicts = [one(item, None) for item in work]
    save_dir = options.get("save_failing")
    if save_dir:
        # A replay that died before it could report leaves its inputs pending: they reproduce.
        for p in Path(save_dir).glob("*.kdump.pending"):
            p.rename(p.with_suffix(""))
    return verdicts


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


@dataclass(frozen=True)
class SanitizerPlan:
    """How sanitizer replays run: tools, whether the graph chain runs too, which binary."""

    tools: tuple[str, ...]
    graph: bool
    binary: str | None
    timeout: float | None
    kernel_filter: str | None


def _sanitize(base: Request, plan: SanitizerPlan, env: dict[str, str] | None) -> Verdict:
    from kdump.replay.sanitizer import find_sanitizer, run_sanitizer

    binary = find_sanitizer(plan.binary)
    combined: Verdict | None = None
    for m in ["eager"] + (["graph"] if plan.graph else []):
        for tool in plan.tools:
            req = replace(base, mode=m, repeat=1)
            v = run_sanitizer(req, tool, binary, plan.timeout, plan.kernel_filter, env)
            combined = _merge(combined, v, f"sanitizer/{tool}" + ("/graph" if m == "graph" else ""))
    assert combined is not None
    combined.mode = "sanitizer"
    return combined


def _all(
    base: Request,
    plan: SanitizerPlan,
    run: Callable[[str], Verdict],
    env: dict[str, str] | None,
) -> Verdict:
    """eager, graph (on a GPU) and sanitizer (when found) in one verdict."""
    from kdump.errors import CannotRunError
    from kdump.replay.sanitizer import find_sanitizer

    combined = _merge(None, run("eager"), "eager")
    if combined.device.startswith("cuda"):
        combined = _merge(combined, run("graph"), "graph")
        try:
            binary = find_sanitizer(plan.binary)
        except CannotRunError as exc:
            combined.notes.append(f"sanitizer skipped: {exc}")
        else:
            sanitized = _sanitize(base, replace(plan, binary=str(binary), graph=False), env)
            combined = _merge(combined, sanitized, "sanitizer")
    else:
        combined.notes.append("graph and sanitizer modes skipped: no CUDA GPU")
    combined.mode = "all"
    return combined


def _merge(into: Verdict | None, v: Verdict, prefix: str) -> Verdict:
    """Fold `v` into `into`, prefixing step names that do not already carry a mode."""
    for s in v.steps:
        if not s.name.startswith(prefix.split("/")[0] + "/"):
            s.name = f"{prefix}/{s.name}"
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


__all__ = ["Finding", "Request", "Step", "Verdict", "replay"]
