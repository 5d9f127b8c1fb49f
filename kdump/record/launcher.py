"""What `kdump record [options] -- CMD` does: CMD's environment, running it, its summary."""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdump import config
from kdump.errors import ExitCode, UsageError
from kdump.format.journal import RUN_PREFIX
from kdump.progress import Bar
from kdump.record import capture_dir
from kdump.record.flight import announce, salvager
from kdump.text import visible as v

STARTUP_DIR = Path(__file__).resolve().parent / "_startup"

# Options of `kdump record` and the variables they set in CMD's processes.
OPTION_VARS = {
    "out": "KDUMP_OUT",
    "mode": "KDUMP_MODE",
    "calls": "KDUMP_CALLS",
    "every": "KDUMP_EVERY",
    "first_per_signature": "KDUMP_FIRST_PER_SIGNATURE",
    "ranks": "KDUMP_RANKS",
    "predicate": "KDUMP_PREDICATE",
    "max_bundles": "KDUMP_MAX_BUNDLES",
    "max_bytes": "KDUMP_MAX_BYTES",
    "keep": "KDUMP_KEEP",
    "outputs": "KDUMP_OUTPUTS",
    "flush_signal": "KDUMP_FLUSH_SIGNAL",
    "log_file": "KDUMP_LOG",
    "ring_slots": "KDUMP_RING_SLOTS",
    "slot_bytes": "KDUMP_SLOT_BYTES",
    "device_bytes": "KDUMP_DEVICE_BYTES",
    "static_bytes": "KDUMP_STATIC_BYTES",
}
DEFAULT_MODE = "ring"  # `kdump record` runs the flight recorder unless told otherwise
STDERR_TAIL = 8192
_PATH_OPTIONS = ("out", "log_file")  # made absolute: children may chdir


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")


def launch(
    cmd: list[str],
    targets: tuple[str, ...],
    opts: Mapping[str, Any],
    echo: Callable[[str], None] = _stderr,
) -> int:
    """Validate the options (UsageError), run CMD with recording active, print the summary;
    CMD's exit code (2 when CMD succeeded but what it recorded could not be written)."""
    from kdump.record.config import RecordConfig
    from kdump.record.hooks import parse_targets
    from kdump.record.session import check_mode
    from kdump.record.startup import signal_number

    env = build_env(config.environ(), targets, opts)
    cfg = RecordConfig.from_env(env)  # validate here: a bad option is one line, exit 2
    check_mode(cfg.mode)
    parse_targets(list(cfg.targets))
    flush_sig = signal_number(opts["flush_signal"]) if opts.get("flush_signal") else None
    started = time.time()
    out = Path(cfg.out)
    prepare_out(out)  # before the program runs: a bad folder must not cost the recording
    if opts.get("cuda_coredump"):
        env.update(coredump_env(out, env))
    holder: salvager.Started | None = None
    env.pop(announce.ENV, None)  # an outer `kdump record`'s salvage process is not ours
    # The run's folder: the journals (mode ring) and, in every mode, what each recorded process
    # says about its targets (kdump.record.session.Recording.write_status).
    run_dir = make_run_dir(cfg.ring.journal_dir, ring=cfg.mode == "ring")
    if run_dir is not None:
        env["KDUMP_JOURNAL_DIR"] = str(run_dir)
    journals = run_dir if cfg.mode == "ring" else None
    if journals is not None and opts.get("salvage_process", True):
        got = salvager.start(journals, config.environ(), flush_sig)
        if isinstance(got, str):
            echo(f"kdump: {got}; the flight recorder keeps its host tier only")
        else:
            holder = got
            env[announce.ENV] = str(got.socket_path)
    tail = bytearray()
    rc: int | None = None
    salvage_failed = False
    status = RunStatus()
    try:
        rc = run(cmd, env, flush_signal=flush_sig, stderr_tail=tail if journals else None)
    finally:  # also when kdump itself is interrupted
        if run_dir is not None:
            status = read_statuses(run_dir)
        if journals is not None:
            if holder is not None:  # its files must be complete before salvage reads them
                report_salvager(salvager.finish(holder), echo)
            context = crash_context(rc, tail, coredumps(out, started))
            salvage_failed = not salvage_run(journals, out, context, echo).ok
        elif run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # a killed program's partial files (sync mode)
            capture_dir.remove_stale_temporaries(out)
    failed = report_failures(status, echo) or salvage_failed
    summarize(out, started, cfg.targets, echo, status=status, failed=failed)
    rc = 130 if rc is None else rc
    return rc if rc != 0 or not failed else int(ExitCode.USAGE)


def prepare_out(out: Path) -> None:
    """Create the output folder and check that it takes files: UsageError (one line, exit 2)
    when it cannot, before anything runs."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"output folder {v(out)} is a file; give a folder with -o")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kdump-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise UsageError(f"output folder {v(out)} is not writable ({why}); give another with -o")


def make_run_dir(journal_dir: Path, *, ring: bool) -> Path | None:
    """A fresh `kdump-run-*` folder under the journal folder. Mode ring needs it (UsageError
    when it cannot be made); in mode sync it only carries the processes' status files, so a
    folder that cannot be made costs only the summary's detail (None)."""
    try:
        journal_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=journal_dir))
    except OSError as exc:
        if ring:
            raise UsageError(
                f"cannot make the journals' folder in {v(journal_dir)} ({exc.strerror or exc}); "
                "set KDUMP_JOURNAL_DIR to a writable folder in shared memory"
            )
        return None


@dataclass
class RunStatus:
    """What the recorded processes said about their targets (kdump-status-*.json)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)
    processes: int = 0


def read_statuses(run_dir: Path) -> RunStatus:
    """Read and remove the status files of the run's processes (their content is checked: a
    process of the program may write anything there)."""
    from kdump.record.session import STATUS_PREFIX

    got = RunStatus()
    for p in sorted(run_dir.glob(f"{STATUS_PREFIX}*")):
        try:
            doc = json.loads(p.read_text()) if p.name.endswith(".json") else None
        except (OSError, ValueError):
            doc = None
        p.unlink(missing_ok=True)
        if not isinstance(doc, dict):
            continue
        got.processes += 1
        pid = doc.get("pid") if type(doc.get("pid")) is int else 0
        rows = doc.get("targets")
        for row in rows if isinstance(rows, list) else []:
            if isinstance(row, dict) and all(isinstance(row.get(k), str) for k in _ROW_KEYS):
                got.rows.append(row)
        fails = doc.get("failures")
        for line in fails if isinstance(fails, list) else []:
            if isinstance(line, str):
                got.failures.append((pid, line))
    return got


_ROW_KEYS = ("target", "id", "module", "state")


def report_failures(status: RunStatus, echo: Callable[[str], None]) -> bool:
    """Say why recording stopped in the program's processes; True when a bundle could not be
    written (the recording is incomplete: kdump's exit code says so)."""
    for pid, line in status.failures[:10]:
        echo(f"kdump: process {pid}: {v(line)}")
    if len(status.failures) > 10:
        echo(f"kdump: ... and {len(status.failures) - 10} more failure(s)")
    return any("writing" in line for _, line in status.failures)


COREDUMP_PATTERN = "cuda-coredump.%h.%p.nvcudmp"  # the driver fills in host name and pid


def coredump_env(out: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The CUDA driver's variables that make a GPU exception write a GPU core dump into `out`
    (one per process). A host core dump is left off unless the user's environment asks for it:
    it can be as large as the process."""
    out.mkdir(parents=True, exist_ok=True)
    got = {
        "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
        "CUDA_COREDUMP_FILE": str(out.resolve() / COREDUMP_PATTERN),
    }
    if "CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION" not in env:
        got["CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION"] = "0"
    return got


def coredumps(out: Path, since: float) -> dict[int, Path]:
    """The GPU core dumps written in `out` since `since`, by process id."""
    found: dict[int, Path] = {}
    for p in out.glob(COREDUMP_PATTERN.replace("%h", "*").replace("%p", "*")):
        try:
            if p.stat().st_mtime < since - 1:
                continue
            found[int(p.name.rsplit(".", 2)[-2])] = p
        except (OSError, ValueError):
            continue
    return found


def report_salvager(done: salvager.Finished, echo: Callable[[str], None]) -> None:
    if done.written:
        echo(f"kdump: salvage process: wrote the device tier of {len(done.written)} memory(ies)")
    for line in done.failed:
        echo(f"kdump: salvage process: {v(line)}")
    if done.problem:
        echo(f"kdump: {done.problem}; salvaging the host tier only where it lacks a file")


def crash_context(
    rc: int | None, tail: bytes, cores: Mapping[int, Path] | None = None
) -> dict[str, Any]:
    """How the program ended, for every salvaged bundle's meta; `cores`: the GPU core dumps
    written, by pid (salvage_run names each journal's own)."""
    ctx: dict[str, Any] = {}
    if cores:
        ctx["cuda_coredumps"] = {str(pid): str(p) for pid, p in sorted(cores.items())}
    if rc is not None:
        if rc > 128:
            ctx["signal"] = rc - 128
            with contextlib.suppress(ValueError):
                ctx["signal_name"] = signal.Signals(rc - 128).name
        else:
            ctx["exit_code"] = rc
    ctx["stderr_tail"] = bytes(tail[-STDERR_TAIL:]).decode("utf-8", "replace")
    return ctx


@dataclass
class Salvaged:
    """What `salvage_run` wrote, and whether every journal could be salvaged."""

    bundles: list[Path]
    ok: bool


def salvage_run(
    journals: Path, out: Path, context: dict[str, Any], echo: Callable[[str], None] = _stderr
) -> Salvaged:
    """Turn every journal the run's processes left into bundles (under out/flight.HOST), then
    remove the run's shared-memory folder (the salvage process' device-tier files with it).
    A journal that cannot be salvaged stays there, with the command that recovers it."""
    from kdump.progress import PLAIN_INTERVAL_S, progress

    written: list[Path] = []
    failed: list[Path] = []
    try:
        label = "kdump: salvaging the flight recorder"
        with progress(label, None, quiet_for=PLAIN_INTERVAL_S) as bar:
            written = _salvage_each(journals, out, context, bar, echo, failed)
    except BaseException:  # interrupted (a third Ctrl-C) or worse: nothing may be lost
        _keep_for_salvage(journals, echo)
        raise
    if failed:
        _keep_for_salvage(journals, echo)
    else:
        shutil.rmtree(journals, ignore_errors=True)
    return Salvaged(written, not failed)


def _keep_for_salvage(journals: Path, echo: Callable[[str], None]) -> None:
    """Leave the journals that failed (and their device-tier files) for `kdump salvage`."""
    for p in journals.glob("*.tmp"):
        p.unlink(missing_ok=True)
    echo(
        f"kdump: the journals are kept in {v(journals)}; recover them with: "
        f"kdump salvage {shlex.quote(str(journals))} -o OTHER_FOLDER"
    )


def _salvage_each(
    journals: Path,
    out: Path,
    context: dict[str, Any],
    bar: Bar,
    echo: Callable[[str], None],
    failed: list[Path],
) -> list[Path]:
    from kdump.record.flight.journal_reader import read_pid
    from kdump.record.flight.salvage import CRASH_SUFFIX, RAISED_SUFFIX, salvage_journal
    from kdump.record.flight.statics import STATIC_SUFFIX

    cores = context.get("cuda_coredumps") or {}
    written: list[Path] = []
    for j in sorted(journals.glob("kdump-journal-*")):
        if j.name.endswith(
            (CRASH_SUFFIX, RAISED_SUFFIX, STATIC_SUFFIX, ".tmp")
        ) or announce.is_device_file(j):
            continue
        own = context
        with contextlib.suppress(Exception):
            core = cores.get(str(read_pid(j)))
            if core:
                own = {**context, "cuda_coredump": core}
        try:
            res = salvage_journal(j, out / f"flight.{socket.gethostname()}", own, progress=bar)
        except Exception as exc:  # one bad journal must not lose the others
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            echo(f"kdump: cannot salvage {j.name} ({type(exc).__name__}: {v(why)})")
            if j.exists():
                failed.append(j)
            continue
        written += res.bundles
        echo(
            f"kdump: flight recorder: {len(res.bundles)} call(s) salvaged from {j.name}, "
            f"{len(res.in_flight)} in flight, {len(res.torn)} torn; report {res.report}"
        )
    return written


def build_env(
    base: Mapping[str, str], targets: tuple[str, ...], opts: Mapping[str, Any]
) -> dict[str, str]:
    """CMD's environment: options become KDUMP_* variables; the startup folder leads PYTHONPATH."""
    env = dict(base)
    env["KDUMP_RECORD"] = "1"
    if targets:
        env["KDUMP_TARGETS"] = ",".join(targets)
    for key, var in OPTION_VARS.items():
        value = opts.get(key)
        if value is not None:
            env[var] = str(Path(value).resolve()) if key in _PATH_OPTIONS else str(value)
    if opts.get("mode") is None and not config.get("KDUMP_MODE", env):
        env["KDUMP_MODE"] = DEFAULT_MODE
    if opts.get("on_exception") is not None:
        env["KDUMP_ON_EXCEPTION"] = "1" if opts["on_exception"] else "0"
    out = config.get("KDUMP_OUT", env) or "kdump-out"
    env["KDUMP_OUT"] = str(Path(out).resolve())
    paths = [str(STARTUP_DIR)]  # holds only sitecustomize.py, which takes itself off sys.path
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    return env


class _StopWaiting(Exception):
    """A second Ctrl-C: stop waiting for the program (what it recorded is still salvaged)."""


def run(
    cmd: list[str],
    env: Mapping[str, str],
    flush_signal: int | None = None,
    stderr_tail: bytearray | None = None,
) -> int | None:
    """Run CMD; SIGTERM / SIGINT (and the flush signal) sent to kdump go to CMD; CMD's exit code
    comes back (death by signal n -> 128 + n, as shells report it), None when a second SIGINT
    made kdump stop waiting for it. With `stderr_tail`, CMD's stderr passes through kdump
    unchanged and its last bytes are kept there."""
    try:
        proc = subprocess.Popen(
            cmd, env=dict(env), stderr=subprocess.PIPE if stderr_tail is not None else None
        )
    except FileNotFoundError:
        raise UsageError(f"command not found: {cmd[0]}; give the program's path or put it on PATH")
    tee = None
    if stderr_tail is not None:
        tee = threading.Thread(target=_tee, args=(proc.stderr, stderr_tail), daemon=True)
        tee.start()
    interrupts = 0

    def forward(signum: int, frame: Any) -> None:
        nonlocal interrupts
        try:
            proc.send_signal(signum)
        except OSError:
            pass
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts == 2:  # the user insists: salvage now, whatever the program does
                raise _StopWaiting

    forwarded = [signal.SIGTERM, signal.SIGINT] + ([flush_signal] if flush_signal else [])
    previous = {s: signal.signal(s, forward) for s in forwarded}
    rc: int | None = None
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:
                continue
            except _StopWaiting:
                _stderr(
                    f"kdump: stopped waiting for the program (pid {proc.pid}); salvaging what "
                    "it recorded so far"
                )
                break
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if tee is not None:
            tee.join(timeout=5 if rc is not None else 0.5)
    if rc is None:
        return None
    return 128 - rc if rc < 0 else rc


def _tee(src: Any, tail: bytearray) -> None:
    """Copy CMD's stderr to ours as it comes, keeping the last STDERR_TAIL bytes."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    fd = src.fileno()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        if out is not None:
            with contextlib.suppress(OSError, ValueError):
                out.write(chunk)
                out.flush()
        tail += chunk
        del tail[: max(0, len(tail) - STDERR_TAIL)]


def _tree_bytes(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    return sum(b.stat().st_size for b in folder.rglob("*") if b.is_file())


def summarize(
    out: Path,
    since: float,
    targets: tuple[str, ...],
    echo: Callable[[str], None] = _stderr,
    *,
    status: RunStatus | None = None,
    failed: bool = False,
) -> None:
    """What the run wrote (bundles newer than `since`, read through the folders' indexes), and
    the exact next command. `status`: what the processes said about their targets; `failed`:
    something could not be written (then "no calls were recorded" would be false)."""
    from kdump.text import human_bytes

    status = status or RunStatus()
    bundles: list[Path] = []
    for p in capture_dir.list_bundles(out):
        try:
            if p.stat().st_mtime >= since - 1:
                bundles.append(p)
        except OSError:
            continue
    bundles.sort(key=lambda p: (p.parent.name, p.name))
    if not bundles:
        if failed or status.failures:  # calls were made: recording them failed
            echo("kdump: no bundles were written (see above)")
        else:
            echo(f"kdump: no calls were recorded: {why_nothing(targets, status)}")
        return
    folders = sorted({p.parent for p in bundles})
    nbytes = sum(p.stat().st_size for p in bundles)
    blob_bytes = _tree_bytes(out / capture_dir.STORE_DIRNAME)
    blob_bytes += sum(_tree_bytes(f / capture_dir.STORE_DIRNAME) for f in folders)
    echo(
        f"kdump: wrote {len(bundles)} bundle(s), {human_bytes(nbytes + blob_bytes)} "
        f"(shared blobs included) in {len(folders)} process folder(s) under {v(out)}:"
    )
    for f in folders:
        n = sum(1 for p in bundles if p.parent == f)
        index = f / capture_dir.INDEX_NAME  # sync mode's folders have one; salvaged ones not
        said = f", index: {v(index)}" if index.exists() else ""
        echo(f"  {v(f)}  ({n} bundle(s){said})")
    echo(f"next: {v(next_command(bundles[0], status))}")


def why_nothing(targets: tuple[str, ...], status: RunStatus) -> str:
    """Why a run recorded no call, as precisely as the processes' status files tell: a target
    module the program never imported, one without the named function, or (when every target
    was patched) calls that did not happen or that the triggers passed over."""
    from kdump.record.hooks import parse_target

    named = ", ".join(targets) or "deep_gemm"
    generic = f"targets {v(named)}; check that the program calls them, and the trigger options"
    if not status.processes:
        return generic
    reasons: list[str] = []
    for text in targets or ("deep_gemm",):
        try:
            texts = {s.text for s in parse_target(text)}
        except Exception:
            continue
        rows = [r for r in status.rows if r["target"] in texts]
        if not rows or any(r["state"] == "patched" for r in rows):
            continue
        missing = [r for r in rows if r["state"] == "missing"]
        if missing:
            r = missing[0]
            name = r["target"].partition(":")[2] or r["target"]
            reasons.append(f"target module {v(r['module'])} has no {v(name)} (target {v(text)})")
        elif all(r["state"] == "not_imported" for r in rows):
            mods = sorted({r["module"] for r in rows})
            shown = ", ".join(mods[:3]) + (", ..." if len(mods) > 3 else "")
            reasons.append(
                f"target module {v(shown)} was never imported by the program (target {v(text)})"
            )
        else:
            reasons.append(f"operator of target {v(text)} was never registered")
    return "; ".join(reasons) if reasons else generic


def next_command(bundle: Path, status: RunStatus) -> str:
    """`kdump replay BUNDLE`, with `--allow-target` for each recorded target that no plug-in
    claims and the user's config does not allow, and `--path` for each whose module a replay
    would not find (it came from the program's folder, or from a sys.path entry the program
    added)."""
    from kdump.kernels.registry import target_allowed

    words = ["kdump", "replay", str(bundle)]
    seen: set[str] = set()
    globs = [r["id"] for r in status.rows if r["state"] == "patched" and "*" in r["id"]]
    for row in status.rows:
        if row["state"] != "patched" or row["id"] in seen:
            continue
        seen.add(row["id"])
        try:
            allowed = target_allowed(row["id"])
        except Exception:  # an unreadable config file: the replay says so itself
            allowed = False
        if allowed:
            continue
        covered = row["id"] not in globs and any(fnmatch.fnmatchcase(row["id"], g) for g in globs)
        if not covered:  # (a 'mod:*' given as well allows it)
            words += ["--allow-target", row["id"]]
        root = row.get("root")
        if isinstance(root, str) and not _replay_imports_from(row["module"], root):
            if root not in words:
                words += ["--path", root]
    return " ".join(shlex.quote(w) for w in words)


def _replay_imports_from(module: str, root: str) -> bool:
    """Whether a replay child started here imports `module` from `root` (where it finds the
    package: kdump.replay.child.module_origin)."""
    from kdump.replay.child import module_origin

    origin = module_origin(module)
    return bool(origin) and os.path.realpath(origin).startswith(os.path.realpath(root) + os.sep)
