"""The parent side of the fuzz campaign: a few long-lived workers, each fed one case at a time;
a worker that dies or stops answering is replaced and its case reported as a finding."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fuzz.mutate import Case
from fuzz.worker import CASE_SECONDS, save_failure

WORKER = Path(__file__).with_name("worker.py")
ANSWER_SECONDS = CASE_SECONDS + 20  # the worker's own alarm fires first; this catches the rest


@dataclass(frozen=True)
class Finding:
    case: Case
    why: str
    saved: str


class _Worker:
    def __init__(self, n: int, bases: Path, failures: Path, env: dict[str, str]) -> None:
        self.scratch = failures.parent / f"scratch{n}"
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(bases), str(failures), str(self.scratch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.case: Case | None = None
        self.sent = 0.0
        self.id = 0
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        assert ready.strip() == '{"ready": true}', f"fuzz worker did not start: {ready!r}"

    def send(self, case: Case, case_id: int, as_json: bool) -> None:
        assert self.proc.stdin is not None
        self.case, self.id, self.sent = case, case_id, time.monotonic()
        self.proc.stdin.write(json.dumps({"id": case_id, "case": asdict(case), "json": as_json}))
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def run_campaign(
    cases: list[Case],
    bases: Path,
    failures: Path,
    workers: int = 2,
    env: dict[str, str] | None = None,
) -> tuple[dict[str, int], list[Finding]]:
    """Run every case; how many ended each way, and the findings (cases that ended otherwise)."""
    env = dict(env if env is not None else os.environ)
    failures.mkdir(parents=True, exist_ok=True)
    todo = list(enumerate(cases))[::-1]
    endings: dict[str, int] = {}
    findings: list[Finding] = []
    pool = [_Worker(n, bases, failures, env) for n in range(workers)]
    sel = selectors.DefaultSelector()
    busy: dict[int, _Worker] = {}

    def feed(w: _Worker) -> None:
        if todo:
            i, case = todo.pop()
            w.send(case, i, as_json=i % 3 == 0)
            assert w.proc.stdout is not None
            sel.register(w.proc.stdout, selectors.EVENT_READ, w)
            busy[id(w)] = w

    def lost(w: _Worker, why: str) -> _Worker:
        assert w.case is not None
        findings.append(Finding(w.case, why, str(save_failure(w.case, bases, failures, why))))
        w.stop()
        fresh = _Worker(len(pool), bases, failures, env)
        pool.append(fresh)
        return fresh

    try:
        for w in pool:
            feed(w)
        while busy:
            for key, _ in sel.select(timeout=1.0):
                w = key.data
                sel.unregister(key.fileobj)
                del busy[id(w)]
                line = w.proc.stdout.readline() if w.proc.stdout else ""
                if not line:
                    w = lost(w, f"worker died (exit {w.proc.wait()}) on this case")
                else:
                    reply = json.loads(line)
                    if reply["ok"]:
                        key_ = reply["ended"].split(" / info")[0]
                        endings[key_] = endings.get(key_, 0) + 1
                    else:
                        assert w.case is not None
                        findings.append(Finding(w.case, reply["why"], reply.get("saved", "")))
                feed(w)
            now = time.monotonic()
            for w in list(busy.values()):
                if now - w.sent > ANSWER_SECONDS:
                    assert w.proc.stdout is not None
                    sel.unregister(w.proc.stdout)
                    del busy[id(w)]
                    feed(lost(w, f"worker did not answer within {ANSWER_SECONDS} s"))
    finally:
        for w in pool:
            w.stop()
    return endings, findings
