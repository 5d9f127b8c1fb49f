"""Run a replay request in a child process so that a crash, an abort or a hang becomes a verdict
instead of killing kdump.

The child streams events (step begun, step result, finding, note) into a progress file as they
happen; when it dies, the parent rebuilds the verdict from them and names the step that was
running. A chain (graph mode) whose process died goes on in a fresh process from the next step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kdump.replay.session import Request
from kdump.replay.verdict import Finding, Step, Verdict

STDERR_TAIL = 1500
MAX_RESTARTS = 32


@dataclass
class ChildRun:
    verdict: Verdict
    died_at: str | None = None  # step that was running when the process died or hung
    begun: list[str] = field(default_factory=list)


def read_events(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by the crash
    return out


def worker_command(req_path: Path, result_path: Path, progress_path: Path) -> list[str]:
    """The replay worker's command line (kdump.replay.worker)."""
    return [
        sys.executable,
        "-m",
        "kdump.replay.worker",
        str(req_path),
        str(result_path),
        str(progress_path),
    ]


def child_environment(base: dict[str, str] | None, **extra: str) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("KDUMP_RECORD", None)  # a replay is never recorded
    env.update(extra)
    return env


def run_group(cmd: list[str], env: dict[str, str], timeout: float | None) -> tuple[int | None, str]:
    """Run `cmd` in its own process group; (exit status, stderr), status None after a hang (the
    whole group is killed: a sanitizer's child too)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err or ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err or ""


def verdict_from_events(req: Request, events: list[dict[str, Any]]) -> Verdict:
    """What a child reported before it died: its steps, findings, notes and setup."""
    v = Verdict(req.bundle, req.call, "", req.mode, req.backend, req.device)
    for e in events:
        if "step" in e:
            v.steps.append(Step(**e["step"]))
        elif "finding" in e:
            v.findings.append(Finding(**e["finding"]))
        elif "note" in e:
            v.notes.append(e["note"])
        elif "meta" in e:
            v.target = e["meta"].get("target", v.target)
            v.backend = e["meta"].get("backend", v.backend)
            v.device = e["meta"].get("device", v.device)
    return v


def _run_child(req: Request, timeout: float | None, env: dict[str, str] | None) -> ChildRun:
    with tempfile.TemporaryDirectory(prefix="kdump-replay-") as tmp:
        req_path = Path(tmp, "request.json")
        result_path = Path(tmp, "result.json")
        progress_path = Path(tmp, "progress")
        req_path.write_text(json.dumps(asdict(req)))
        cmd = worker_command(req_path, result_path, progress_path)
        rc, err = run_group(cmd, child_environment(env), timeout)
        hung = rc is None
        events = read_events(progress_path)
        begun = [e["begin"] for e in events if "begin" in e]
        if result_path.exists() and not hung:
            return ChildRun(Verdict.from_json(json.loads(result_path.read_text())), None, begun)
        v = verdict_from_events(req, events)
        last = begun[-1] if begun else f"{req.mode}/setup"
        tail = (err or "")[-STDERR_TAIL:].strip()
        if hung:
            msg = f"hang: no result after {timeout:g} s, killed"
            v.steps.append(Step(last, "error", msg))
            v.findings.append(Finding("hang", last, msg, {"stderr_tail": tail}))
        else:
            assert rc is not None
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
            cause = _cause(tail)
            msg = f"the replay process died ({how}){': ' + cause if cause else ''}"
            v.steps.append(Step(last, "error", msg))
            v.findings.append(Finding("kernel_error", last, msg, {"stderr_tail": tail}))
        return ChildRun(v, last, begun)


def _crashed_replay(run: ChildRun) -> str | None:
    """The graph replay step that killed the CUDA context in this run, if any."""
    if run.died_at is not None:
        return run.died_at if run.died_at.startswith("graph/replay") else None
    for f in run.verdict.findings:
        if f.kind == "kernel_error" and f.step.startswith("graph/replay"):
            return f.step
    return None


def run_in_child(req: Request, timeout: float | None, env: dict[str, str] | None = None) -> Verdict:
    """Run `req`. In graph mode, when a replay kills the CUDA context the chain goes on from the
    next step in a fresh process (the request's `options["skip_steps"]` lists steps done)."""
    run = _run_child(req, timeout, env)
    verdict = run.verdict
    done = set(req.options.get("skip_steps", []))
    for _ in range(MAX_RESTARTS):
        crashed = _crashed_replay(run) if req.mode == "graph" else None
        if crashed is None:
            break
        done |= {b for b in run.begun if b.startswith("graph/replay")} | {crashed}
        req = replace(req, options={**req.options, "skip_steps": sorted(done)})
        run = _run_child(req, timeout, env)
        verdict.steps.append(Step("restart", "ok", f"fresh process after {crashed}"))
        verdict.steps.extend(s for s in run.verdict.steps if s.name.startswith("graph/replay"))
        verdict.findings.extend(
            f for f in run.verdict.findings if f.step.startswith("graph/replay")
        )
        verdict.notes.extend(n for n in run.verdict.notes if n not in verdict.notes)
    return verdict


def _cause(stderr: str) -> str:
    """The most telling line of a dead child's stderr."""
    keys = (
        "illegal memory access",
        "illegal address",
        "misaligned",
        "CUDA error",
        "Segmentation fault",
        "terminate called",
        "Error",
    )
    for key in keys:
        for line in stderr.splitlines():
            if key.lower() in line.lower():
                return line.strip()[:300]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else ""


def run_in_process(req: Request) -> Verdict:
    from kdump.replay.worker import run_request

    return run_request(asdict(req), None)
