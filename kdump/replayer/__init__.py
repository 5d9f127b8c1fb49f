"""Offline replay of recorded calls: eager, graph, sanitizer.

`replay()` runs each (bundle, call) in a child process (a crash becomes a verdict) and returns
one Verdict per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from kdump.bundle import iter_bundles, load_bundle
from kdump.errors import UsageError
from kdump.replayer.session import Request
from kdump.replayer.verdict import Finding, Step, Verdict

MODES = ("eager", "graph")


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
) -> list[Verdict]:
    from kdump.replayer.isolate import run_in_child, run_in_process

    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    verdicts = []
    for path in iter_bundles(paths):
        bundle = load_bundle(path)  # validate in the parent: a bad bundle is exit 2, not a crash
        indices = [c.index for c in bundle.calls] if calls is None else list(calls)
        for i in indices:
            bundle.call(i)
            req = Request(str(path), i, mode, backend, device, repeat, force, dict(options or {}))
            v = run_in_child(req, timeout) if isolate else run_in_process(req)
            if not v.target:
                v.target = bundle.call(i).target
            verdicts.append(v)
    return verdicts


__all__ = ["Finding", "Request", "Step", "Verdict", "replay"]
