"""What `kdump record [options] -- CMD` does: CMD's environment, running it, its summary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kdump import config
from kdump.errors import UsageError
from kdump.record import capture_dir

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
}
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
    if opts.get("flush_signal"):
        signal_number(opts["flush_signal"])
    started = time.time()
    rc = run(cmd, env)
    summarize(Path(cfg.out), started, cfg.targets, echo)
    return rc


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
    if opts.get("on_exception") is not None:
        env["KDUMP_ON_EXCEPTION"] = "1" if opts["on_exception"] else "0"
    out = config.get("KDUMP_OUT", env) or "kdump-out"
    env["KDUMP_OUT"] = str(Path(out).resolve())
    paths = [str(STARTUP_DIR)]  # holds only sitecustomize.py, which takes itself off sys.path
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    return env


def run(cmd: list[str], env: Mapping[str, str]) -> int:
    """Run CMD; SIGTERM / SIGINT sent to kdump go to CMD; CMD's exit code comes back
    (death by signal n -> 128 + n, as shells report it)."""
    try:
        proc = subprocess.Popen(cmd, env=dict(env))
    except FileNotFoundError:
        raise UsageError(f"command not found: {cmd[0]}; give the program's path or put it on PATH")

    def forward(signum: int, frame: Any) -> None:
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
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
    return 128 - rc if rc < 0 else rc


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
    from kdump.text import visible as v  # folder names and targets come from the recorded run

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
