"""The one protocol between kdump and a replay child process, in every mode.

The parent writes the request (bundle, call, options as a dict) into a fresh folder and runs
`python -m kdump.replay.child FOLDER`, directly or under compute-sanitizer. The child appends
progress events to FOLDER/progress as they happen (one JSON object a line: started, begin, step,
finding, note, meta, placed), lets faulthandler write a fatal signal's report to FOLDER/fault, and
writes FOLDER/result.json atomically when it is done. The parent judges what came back:

- a result: the child's verdict;
- a hang (timeout): a `hang` finding naming the step that was running;
- progress but no result (a signal, a nonzero exit): a `kernel_error` naming the step that was
  running and the cause (signal name, stderr tail);
- neither progress nor result: the replay never ran (e.g. a sanitizer binary that exits without
  starting it): an `internal` finding naming the cause.

A graph chain whose process died goes on in a fresh process from the next step.

An eager replay of many bundles reuses worker processes (`WorkerPool`): a worker started as
`python -m kdump.replay.child --serve FD` reads job folders from stdin, one a line, runs each
exactly as above and writes "done" to the pipe FD when the job's result is written. A worker is
reused only for the next bundle whose applied environment and library settings are identical
(`reuse_key`), and only after a clean verdict; a worker that dies, hangs or reports anything is
ended, so the bundle it was running is judged as above and the next one gets a fresh process.

Every process started here runs in a process group of its own (a hang kills the whole group),
registered with its temporary folders until it is reaped, and SIGINT / SIGTERM end them all
before kdump stops (kdump.replay.procs: how, and what keeps that from depending on timing). A
replay child started directly gets `--parent PID`: it dies with the process that started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any

from kdump.errors import FindingKind, KdumpError
from kdump.replay.procs import (
    CHILD_GRACE_S,
    die_with_parent,
    forget,
    install_signal_handlers,
    make_temp,
    nest_temps_in,
    remove_temp,
    signal_group,
    spawn,
)
from kdump.replay.session import Request, runs_interpreted
from kdump.replay.verdict import Finding, Step, Verdict

STDERR_TAIL = 1500
MAX_RESTARTS = 32
REQUEST, RESULT, PROGRESS, FAULT = "request.json", "result.json", "progress", "fault"

# faulthandler's first line for each fatal signal it reports.
_FAULT_SIGNALS = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}


@dataclass(frozen=True)
class Ended:
    """How a child process ended, before any judgement."""

    rc: int | None  # None: killed after the timeout
    stderr: str
    events: list[dict[str, Any]]
    result: dict[str, Any] | None
    fault: str = ""  # faulthandler's report of a fatal signal

    @property
    def begun(self) -> list[str]:
        return [e["begin"] for e in self.events if "begin" in e]


@dataclass
class ChildRun:
    verdict: Verdict
    died_at: str | None = None  # step that was running when the process died or hung
    begun: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


MODULE = [sys.executable, "-m", "kdump.replay.child"]


def child_command(folder: Path, parent: int | None = None) -> list[str]:
    """The replay child's command line; with `parent` (this process, when it starts the child
    itself rather than through a wrapper) the child dies with it."""
    dies = ["--parent", str(parent)] if parent is not None else []
    return [*MODULE, *dies, str(folder)]


def child_environment(base: dict[str, str] | None, **extra: str) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("KDUMP_RECORD", None)  # a replay is never recorded
    # The current folder (where a bundle and a .py shipped with it may lie) is not importable in
    # the child from its first import on (Python 3.11+; older ones drop it in `main`) ...
    env["PYTHONSAFEPATH"] = "1"
    # ... except that a kdump run from a source checkout in that folder must still import itself.
    root = str(Path(__file__).resolve().parents[2])
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root == os.path.realpath(os.getcwd()) and root not in entries:
        env["PYTHONPATH"] = os.pathsep.join([*entries, root])
    env.update(extra)
    return env


_FIND_SPEC = (
    "import importlib.util, sys\n"
    "sys.path[:0] = sys.argv[2:]\n"
    "try:\n    s = importlib.util.find_spec(sys.argv[1])\nexcept Exception:\n    s = None\n"
    "print(s.origin or '' if s is not None else '')\n"
    "sys.exit(0 if s is not None else 1)"
)
_origins: dict[tuple[object, ...], str | None] = {}


def module_origin(module: str, paths: Sequence[str] = ()) -> str | None:
    """Where a replay child started here (with `--path paths`) finds the top-level package of
    `module`: its origin ('' for one without a file), None when it finds none. Asked of a fresh
    Python with the replay child's environment (no current folder on sys.path); only the
    top-level package is looked up, so none of the user's code runs."""
    top = module.split(".")[0]
    folders = tuple(os.path.abspath(p) for p in paths)
    env = child_environment(None)
    key = (top, folders, frozenset(env.items()))  # the answer is the environment's
    if key not in _origins:
        try:
            got = subprocess.run(
                [sys.executable, "-c", _FIND_SPEC, top, *folders],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            _origins[key] = got.stdout.strip() if got.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            _origins[key] = None
    return _origins[key]


# --- one replay in a child process -----------------------------------------------------------


def launch(
    req: Request,
    timeout: float | None,
    env: dict[str, str] | None = None,
    wrapper: Sequence[str] = (),
) -> Ended:
    """Run the child for `req` (under `wrapper`, e.g. compute-sanitizer and its flags)."""
    folder = make_temp("kdump-replay-")
    try:
        (folder / REQUEST).write_text(json.dumps(req.to_dict()))
        # Under a wrapper the child's parent is the wrapper, whose way of starting it is its own.
        cmd = [*wrapper, *child_command(folder, None if wrapper else os.getpid())]
        rc, err = run_group(cmd, env or child_environment(None), timeout)
        result = None
        if (folder / RESULT).exists():
            try:
                result = json.loads((folder / RESULT).read_text())
            except ValueError:
                result = None
        fault = (folder / FAULT).read_text(errors="replace") if (folder / FAULT).exists() else ""
        return Ended(rc, err, read_events(folder / PROGRESS), result, fault)
    finally:
        remove_temp(folder)


def run_group(cmd: list[str], env: dict[str, str], timeout: float | None) -> tuple[int | None, str]:
    """Run `cmd` in its own process group; (exit status, stderr), status None after a hang (the
    whole group is killed: a sanitizer's child too)."""
    proc = spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err or ""
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err or ""
    except BaseException:  # interrupted: the replay must not outlive kdump
        signal_group(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        raise
    finally:
        forget(proc)


def read_events(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
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


def judge(req: Request, ended: Ended, timeout: float | None, runner: str) -> ChildRun:
    """The verdict of a child run; `runner` names what ran it, for messages."""
    begun = ended.begun
    if ended.result is not None and ended.rc is not None:
        return ChildRun(Verdict.from_json(ended.result), None, begun, ended.events)
    v = verdict_from_events(req, ended.events)
    tail = ended.stderr[-STDERR_TAIL:].strip()
    details = {"stderr_tail": tail, "exit_status": ended.rc}
    if ended.rc is None:
        last = begun[-1] if begun else f"{req.mode}/setup"
        msg = f"no result after {timeout:g} s; {runner} was killed"
        v.steps.append(Step(last, "error", msg))
        v.findings.append(Finding(FindingKind.HANG.value, last, msg, details))
        return ChildRun(v, last, begun, ended.events)
    if not ended.events:
        cause = _cause(tail) or "no output"
        msg = (
            f"the replay never ran: {runner} ended ({_how(ended)}) before the replay started "
            f"({cause})"
        )
        step = f"{req.mode}/start"
        v.steps.append(Step(step, "error", msg))
        v.findings.append(Finding(FindingKind.INTERNAL.value, step, msg, details))
        return ChildRun(v, step, begun, ended.events)
    last = begun[-1] if begun else f"{req.mode}/setup"
    cause = _fault_frame(ended.fault) or _cause(tail)
    msg = f"the replay process died ({_how(ended)}){': ' + cause if cause else ''}"
    v.steps.append(Step(last, "error", msg))
    v.findings.append(
        Finding(FindingKind.KERNEL_ERROR.value, last, msg, {**details, "fault": ended.fault})
    )
    return ChildRun(v, last, begun, ended.events)


def _how(ended: Ended) -> str:
    """'signal SIGABRT' or 'exit status 3'."""
    rc = ended.rc
    first = ended.fault.strip().splitlines()[0] if ended.fault.strip() else ""
    named = next((s for text, s in _FAULT_SIGNALS.items() if text in first), None)
    if rc is not None and rc < 0:
        return f"signal {signal.Signals(-rc).name}"
    if named:
        return f"signal {named}, exit status {rc}"
    return f"exit status {rc}"


def _fault_frame(fault: str) -> str:
    """'in crash (replay_targets.py:17)': the innermost frame of faulthandler's report."""
    for line in fault.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[6:].partition('", line ')
            number, _, func = rest.partition(" in ")
            return f"in {func} ({Path(path).name}:{number})"
    return ""


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


def run_child(req: Request, timeout: float | None, env: dict[str, str] | None = None) -> ChildRun:
    return judge(req, launch(req, timeout, child_environment(env)), timeout, "the replay process")


# --- reused workers (eager mode) --------------------------------------------------------------


def reuse_key(req: Request, env: dict[str, str] | None) -> str:
    """What a worker process keeps from one replay to the next: the recorded DG_* / DJ_*
    variables it applied, whether it runs Triton kernels in the interpreter, the library
    settings recorded with the bundle and the call, and its environment. Bundles with equal
    keys may share a worker."""
    from kdump.bundle import load_bundle

    bundle = load_bundle(req.bundle)
    recorded = bundle.env.get("env_vars", {}) or {}
    applied = {k: v for k, v in recorded.items() if k.startswith(("DG_", "DJ_"))}
    call = bundle.call(req.call)
    state = call.meta.get("library_state")
    environ = child_environment(env)
    interpreted = runs_interpreted(call, req.device)  # TRITON_INTERPRET stays set in a worker
    return json.dumps(
        [applied, bundle.env.get("libraries"), state, interpreted, sorted(environ.items())],
        sort_keys=True,
        default=str,
    )


class Worker:
    """One replay worker process (`--serve`), its job pipe and its stderr file."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = make_temp("kdump-worker-")
        self._stderr = open(self.folder / "stderr", "w+", errors="replace")  # noqa: SIM115
        read_fd, write_fd = os.pipe()
        try:
            self.proc = spawn(
                # --parent: the kernel ends it with the thread starting it here, a slot thread
                # of replay() (--jobs) that outlives every job, or the main thread
                [*MODULE, "--parent", str(os.getpid()), "--serve", str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                text=True,
                env=env,
                pass_fds=(write_fd,),
            )
        except BaseException:
            os.close(read_fd)
            self._stderr.close()
            remove_temp(self.folder)
            raise
        finally:
            os.close(write_fd)
        self._done = os.fdopen(read_fd, "rb", buffering=0)
        self.jobs = 0

    def run(self, req: Request, timeout: float | None) -> Ended:
        """Run one job; a worker that dies or hangs is ended (rc: its status, None after a hang)."""
        self.jobs += 1
        job = self.folder / f"job{self.jobs}"
        job.mkdir()
        (job / REQUEST).write_text(json.dumps(req.to_dict()))
        err_from = self._stderr.seek(0, os.SEEK_END)
        rc: int | None = 0
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{job}\n")
            self.proc.stdin.flush()
            answer = self._wait_done(timeout)
        except OSError:  # the worker is gone already
            answer = "closed"
        answered = answer == "done"
        if not answered:
            rc = self._end(hung=answer == "timeout")
        self._stderr.flush()
        self._stderr.seek(err_from)
        err = self._stderr.read()
        result = None
        if answered and (job / RESULT).exists():
            try:
                result = json.loads((job / RESULT).read_text())
            except ValueError:
                result = None
        fault = (job / FAULT).read_text(errors="replace") if (job / FAULT).exists() else ""
        return Ended(rc, err, read_events(job / PROGRESS), result, fault)

    def _wait_done(self, timeout: float | None) -> str:
        """ "done" when the worker finished the job, "closed" when it closed the pipe (it died),
        "timeout" when it did neither in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select([self._done], [], [], left)
            if not ready:
                return "timeout"
            line = self._done.readline()
            if not line:
                return "closed"
            if line.strip() == b"done":
                return "done"

    def _end(self, *, hung: bool) -> int | None:
        """Stop the worker's whole process group; its exit status, None when it had hung."""
        if not hung:
            try:
                return self.proc.wait(timeout=30)  # it closed the pipe: it is exiting
            except subprocess.TimeoutExpired:
                pass  # closed the pipe but lives on: stop it as a hang
        signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        forget(self.proc)
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # end of jobs: the worker exits
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._end(hung=True)
        forget(self.proc)
        self._done.close()
        self._stderr.close()
        remove_temp(self.folder)


class WorkerPool:
    """Idle workers by reuse key; safe to use from several threads (one job per worker)."""

    def __init__(self) -> None:
        self._idle: dict[str, list[Worker]] = {}
        self._lock = threading.Lock()
        self.started = 0

    def run(self, req: Request, timeout: float | None, env: dict[str, str] | None) -> ChildRun:
        key = reuse_key(req, env)
        with self._lock:
            idle = self._idle.get(key, [])
            worker = idle.pop() if idle else None
        if worker is None:
            worker = Worker(child_environment(env))
            self.started += 1
        ended = worker.run(req, timeout)
        run = judge(req, ended, timeout, "the replay process")
        if ended.result is not None and ended.rc == 0 and run.verdict.exit_code == 0:
            with self._lock:
                self._idle.setdefault(key, []).append(worker)
        else:  # a crash, a hang or any finding: the next bundle gets a fresh process
            worker.close()
        return run

    def close(self) -> None:
        with self._lock:
            workers = [w for ws in self._idle.values() for w in ws]
            self._idle.clear()
        for w in workers:
            w.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kill(self) -> None:
        """End every idle worker at once (kdump is being interrupted)."""
        with self._lock:
            workers = [w for ws in self._idle.values() for w in ws]
            self._idle.clear()
        for w in workers:
            w._end(hung=True)
            w.close()


def _crashed_replay(run: ChildRun) -> str | None:
    """The graph replay step that killed the CUDA context in this run, if any."""
    if run.died_at is not None:
        return run.died_at if run.died_at.startswith("graph/replay") else None
    for f in run.verdict.findings:
        if f.kind == FindingKind.KERNEL_ERROR.value and f.step.startswith("graph/replay"):
            return f.step
    return None


def run_in_child(
    req: Request,
    timeout: float | None,
    env: dict[str, str] | None = None,
    pool: WorkerPool | None = None,
) -> Verdict:
    """Run `req`. An eager replay runs in a worker of `pool` when one is given. In graph mode,
    when a replay kills the CUDA context the chain goes on from the next step in a fresh process
    (`options.graph.skip_steps` lists the steps done)."""
    if pool is not None and req.mode == "eager":
        return pool.run(req, timeout, env).verdict
    run = run_child(req, timeout, env)
    verdict = run.verdict
    done = set(req.options.graph.skip_steps)
    for _ in range(MAX_RESTARTS):
        crashed = _crashed_replay(run) if req.mode == "graph" else None
        if crashed is None:
            break
        done |= {b for b in run.begun if b.startswith("graph/replay")} | {crashed}
        graph = replace(req.options.graph, skip_steps=tuple(sorted(done)))
        req = replace(req, options=replace(req.options, graph=graph))
        run = run_child(req, timeout, env)
        verdict.steps.append(Step("restart", "ok", f"fresh process after {crashed}"))
        verdict.steps.extend(s for s in run.verdict.steps if s.name.startswith("graph/replay"))
        verdict.findings.extend(
            f for f in run.verdict.findings if f.step.startswith("graph/replay")
        )
        verdict.notes.extend(n for n in run.verdict.notes if n not in verdict.notes)
    return verdict


def run_in_process(req: Request) -> Verdict:
    return run_request(req, None)


# --- the child side ---------------------------------------------------------------------------


def confine_imports(paths: Sequence[str]) -> None:
    """Imports come from the environment the user started (PYTHONPATH, site-packages) and the
    folders given with --path, never from the current folder or '' entries."""
    cwd = os.path.realpath(os.getcwd())
    kept = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    sys.path[:] = [
        p for p in sys.path if p and (os.path.realpath(p) != cwd or os.path.realpath(p) in kept)
    ]
    sys.path[:0] = [os.path.abspath(p) for p in paths]
    import importlib

    importlib.invalidate_caches()


def _prepare(req: Request) -> None:
    """Before anything is imported for the call: check that its target may run, and apply the
    recorded environment variables the user asked for (--apply-env), and only those."""
    from kdump.bundle import load_bundle
    from kdump.kernels.registry import check_target

    bundle = load_bundle(req.bundle)
    check_target(bundle.call(req.call).target, req.options.allow_targets)
    recorded = bundle.env.get("env_vars")
    recorded = recorded if isinstance(recorded, dict) else {}
    for name in req.options.apply_env:
        value = recorded.get(name)
        if isinstance(value, str) and value != "<redacted>" and "\0" not in value:
            os.environ[name] = value


def run_request(req: Request, progress_path: Path | None) -> Verdict:
    """Run one request in this process; every error becomes a finding."""
    progress_file = open(progress_path, "a", buffering=1) if progress_path else None  # noqa: SIM115

    def progress(kind: str, payload: object) -> None:
        if progress_file:
            value = asdict(payload) if is_dataclass(payload) else payload  # type: ignore[arg-type]
            progress_file.write(json.dumps({kind: value}, default=str) + "\n")
            progress_file.flush()

    progress("started", {"pid": os.getpid()})
    try:
        _prepare(req)

        def fresh(oracle_req: Request) -> Verdict:  # the fresh-eager oracle's own process
            return run_child(oracle_req, req.options.timeout).verdict

        if req.mode == "eager":
            from kdump.replay.eager import run_eager

            return run_eager(req, progress, fresh)
        if req.mode == "graph":
            from kdump.replay.graph import run_graph

            return run_graph(req, progress, fresh)
        raise KdumpError(f"a child process runs eager or graph replays, not {req.mode!r}")
    except KdumpError as exc:
        v = Verdict(req.bundle, req.call, "", req.mode)
        v.findings.append(Finding(exc.finding_kind.value, f"{req.mode}/setup", str(exc)))
        return v
    except Exception as exc:
        v = Verdict(req.bundle, req.call, "", req.mode)
        v.findings.append(
            Finding(
                FindingKind.INTERNAL.value,
                f"{req.mode}/setup",
                f"{type(exc).__name__}: {exc}",
                {"traceback": traceback.format_exc()[-4000:]},
            )
        )
        return v
    finally:
        if progress_file:
            progress_file.close()  # a reused worker runs many requests


def run_job(folder: Path) -> None:
    """Run the request in `folder` and write its result there (atomically)."""
    import faulthandler

    nest_temps_in(folder)  # e.g. the fresh-eager oracle's folder: removed with this one
    fault = open(folder / FAULT, "w")  # noqa: SIM115 (open until the next job or the end)
    faulthandler.enable(file=fault, all_threads=False)
    _faults.append(fault)
    try:
        req = Request.from_dict(json.loads((folder / REQUEST).read_text()))
    except KdumpError as exc:
        req = None
        verdict = Verdict("", 0, "", "")
        verdict.findings.append(Finding(exc.finding_kind.value, "start", str(exc)))
    if req is not None:
        confine_imports(req.options.paths)
        verdict = run_request(req, folder / PROGRESS)
    tmp = folder / (RESULT + ".tmp")
    tmp.write_text(json.dumps(verdict.to_json(), default=str))
    os.replace(tmp, folder / RESULT)
    sys.stdout.flush()
    while len(_faults) > 1:  # faulthandler now writes to the newest
        _faults.pop(0).close()


_faults: list[Any] = []


def serve(done_fd: int) -> None:
    """Worker loop: a job folder a line on stdin, "done" on `done_fd` after each result."""
    with os.fdopen(done_fd, "wb", buffering=0) as done:
        for line in sys.stdin:
            if line.strip():
                run_job(Path(line.strip()))
                done.write(b"done\n")


def main(argv: list[str]) -> None:
    if argv[:1] == ["--parent"]:
        die_with_parent(int(argv[1]))
        argv = argv[2:]
    # kdump's end (SIGTERM to this group) ends the oracle processes this replay started, too
    install_signal_handlers(CHILD_GRACE_S)
    try:
        if argv[:1] == ["--serve"]:
            serve(int(argv[1]))
        else:
            (folder_arg,) = argv
            run_job(Path(folder_arg))
    except SystemExit as end:  # SIGTERM: the stack is unwound (its folders removed); out now
        os._exit(end.code if isinstance(end.code, int) else 1)
    # Skip interpreter teardown: after a sticky CUDA error torch aborts at exit, which would hide
    # nothing (the verdict is written) but pollutes stderr; after SIGTERM it would outlast the
    # parent's grace (torch's takes most of a second on a loaded machine).
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
else:
    # Replays may start their processes from worker threads (--jobs): the handlers are set up
    # here, from the main thread that imports this module, before any of them starts.
    install_signal_handlers()
