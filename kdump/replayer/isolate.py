"""Run a replay request in a child process so that a crash, an abort or a hang becomes a verdict
instead of killing kdump."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from kdump.replayer.session import Request
from kdump.replayer.verdict import Finding, Step, Verdict

STDERR_TAIL = 1500


def run_in_child(req: Request, timeout: float | None, env: dict[str, str] | None = None) -> Verdict:
    with tempfile.TemporaryDirectory(prefix="kdump-replay-") as tmp:
        req_path = Path(tmp, "request.json")
        result_path = Path(tmp, "result.json")
        progress_path = Path(tmp, "progress")
        req_path.write_text(json.dumps(asdict(req)))
        cmd = [
            sys.executable,
            "-m",
            "kdump.replayer.worker",
            str(req_path),
            str(result_path),
            str(progress_path),
        ]
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        child_env.pop("KDUMP_RECORD", None)  # a replay is never recorded
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            hung = True
        last_step = _last_step(progress_path) or f"{req.mode}/setup"
        if result_path.exists() and not hung:
            return Verdict.from_json(json.loads(result_path.read_text()))
        v = Verdict(req.bundle, req.call, "", req.mode, req.backend, req.device)
        tail = (err or "")[-STDERR_TAIL:].strip()
        if hung:
            msg = f"hang: no result after {timeout:g} s, killed"
            v.steps.append(Step(last_step, "error", msg))
            v.findings.append(Finding("hang", last_step, msg, {"stderr_tail": tail}))
            return v
        rc = proc.returncode
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
        cause = _cause(tail)
        msg = f"the replay process died ({how}){': ' + cause if cause else ''}"
        v.steps.append(Step(last_step, "error", msg))
        v.findings.append(Finding("kernel_error", last_step, msg, {"stderr_tail": tail}))
        return v


def _last_step(path: Path) -> str | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return lines[-1] if lines else None


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
    from kdump.replayer.worker import run_request

    return run_request(asdict(req), None)
