"""What `kdump record [options] -- CMD` does: CMD's environment, running it, its summary."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kdump import config
from kdump.errors import UsageError
from kdump.progress import Bar
from kdump.record import capture_dir, salvager
from kdump.record.journal import RUN_PREFIX
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
    CMD's exit code."""
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
    if opts.get("cuda_coredump"):
        env.update(coredump_env(out, env))
    journals = None
    holder: salvager.Started | None = None
    env.pop(salvager.ENV, None)  # an outer `kdump record`'s salvage process is not ours
    if cfg.mode == "ring":
        cfg.ring.journal_dir.mkdir(parents=True, exist_ok=True)
        journals = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir=cfg.ring.journal_dir))
        env["KDUMP_JOURNAL_DIR"] = str(journals)
        if opts.get("salvage_process", True):
            got = salvager.start(journals, config.environ(), flush_sig)
            if isinstance(got, str):
                echo(f"kdump: {got}; the flight recorder keeps its host tier only")
            else:
                holder = got
                env[salvager.ENV] = str(got.socket_path)
    tail = bytearray()
    rc: int | None = None
    try:
        rc = run(cmd, env, flush_signal=flush_sig, stderr_tail=tail if journals else None)
    finally:
        if journals is not None:  # also when kdump itself is interrupted
            if holder is not None:  # its files must be complete before salvage reads them
                report_salvager(salvager.finish(holder), echo)
            context = crash_context(rc, tail, coredumps(out, started))
            salvage_run(journals, out, context, echo)
    summarize(out, started, cfg.targets, echo)
    return rc


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


def salvage_run(
    journals: Path, out: Path, context: dict[str, Any], echo: Callable[[str], None] = _stderr
) -> list[Path]:
    """Turn every journal the run's processes left into bundles (under out/flight.HOST),
    then remove the run's shared-memory folder (the salvage process' device-tier files with
    it)."""
    from kdump.progress import PLAIN_INTERVAL_S, progress

    written: list[Path] = []
    cores = context.get("cuda_coredumps") or {}
    try:
        label = "kdump: salvaging the flight recorder"
        with progress(label, None, quiet_for=PLAIN_INTERVAL_S) as bar:
            written = _salvage_each(journals, out, context, cores, bar, echo)
    finally:
        shutil.rmtree(journals, ignore_errors=True)
    return written


def _salvage_each(
    journals: Path,
    out: Path,
    context: dict[str, Any],
    cores: dict[str, str],
    bar: Bar,
    echo: Callable[[str], None],
) -> list[Path]:
    from kdump.record.journal import read_pid
    from kdump.record.salvage import CRASH_SUFFIX, RAISED_SUFFIX, salvage_journal
    from kdump.record.statics import STATIC_SUFFIX

    written: list[Path] = []
    for j in sorted(journals.glob("kdump-journal-*")):
        if j.name.endswith(
            (CRASH_SUFFIX, RAISED_SUFFIX, STATIC_SUFFIX, ".tmp")
        ) or salvager.is_device_file(j):
            continue
        own = context
        with contextlib.suppress(Exception):
            core = cores.get(str(read_pid(j)))
            if core:
                own = {**context, "cuda_coredump": core}
        try:
            res = salvage_journal(j, out / f"flight.{socket.gethostname()}", own, progress=bar)
        except Exception as exc:  # one bad journal must not lose the others
            echo(f"kdump: cannot salvage {j.name} ({type(exc).__name__}: {exc})")
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


def run(
    cmd: list[str],
    env: Mapping[str, str],
    flush_signal: int | None = None,
    stderr_tail: bytearray | None = None,
) -> int:
    """Run CMD; SIGTERM / SIGINT (and the flush signal) sent to kdump go to CMD; CMD's exit code
    comes back (death by signal n -> 128 + n, as shells report it). With `stderr_tail`, CMD's
    stderr passes through kdump unchanged and its last bytes are kept there."""
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

    def forward(signum: int, frame: Any) -> None:
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    forwarded = [signal.SIGTERM, signal.SIGINT] + ([flush_signal] if flush_signal else [])
    previous = {s: signal.signal(s, forward) for s in forwarded}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if tee is not None:
            tee.join(timeout=5)
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
    out: Path, since: float, targets: tuple[str, ...], echo: Callable[[str], None] = _stderr
) -> None:
    """What the run wrote (bundles newer than `since`, read through the folders' indexes), and
    the exact next command."""
    from kdump.cli.common import human_bytes

    bundles: list[Path] = []
    for p in capture_dir.list_bundles(out):
        try:
            if p.stat().st_mtime >= since - 1:
                bundles.append(p)
        except OSError:
            continue
    bundles.sort(key=lambda p: (p.parent.name, p.name))
    if not bundles:
        echo(
            f"kdump: no calls were recorded (targets: {v(', '.join(targets) or 'deep_gemm')}); "
            "check that the program calls them, and the trigger options"
        )
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
        echo(f"  {v(f)}  ({n} bundle(s), index: {v(f / capture_dir.INDEX_NAME)})")
    echo(f"next: kdump replay {v(bundles[0])}")
