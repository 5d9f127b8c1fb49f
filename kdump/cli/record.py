"""`kdump record [options] -- CMD ...`: run CMD with recording active in all its processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from kdump import config
from kdump.cli.common import human_bytes

STARTUP_DIR = Path(__file__).resolve().parent.parent / "record" / "_startup"

EPILOG = (
    "\b\nExamples:\n"
    "  kdump record -- python -m sglang.launch_server --model-path M --tp 8\n"
    "  kdump record -t deep_gemm --calls 0-99 --max-bytes 20G -o dumps -- python serve.py\n"
    "  kdump record -t mypkg.ops:gemm --outputs all --on-exception -- python train.py\n"
    "\b\nEnvironment (what the options set in CMD's processes):\n" + config.help_table()
)


@click.command(
    "record",
    epilog=EPILOG,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "-t",
    "--target",
    "targets",
    multiple=True,
    help="module:qualname, torch.ops.ns.op, or a preset (deep_gemm, the default). Repeatable.",
)
@click.option("-o", "--out", type=click.Path(), help="Output directory [KDUMP_OUT].")
@click.option("--mode", type=click.Choice(["sync", "ring"]), help="Recording mode [KDUMP_MODE].")
@click.option("--calls", help="Call index ranges, e.g. '0-9,100,200-' [KDUMP_CALLS].")
@click.option("--every", type=int, help="Every N-th call [KDUMP_EVERY].")
@click.option(
    "--first-per-signature",
    type=int,
    help="First K calls per signature [KDUMP_FIRST_PER_SIGNATURE].",
)
@click.option("--ranks", help="Ranks that record, e.g. '0' or '0-3' [KDUMP_RANKS].")
@click.option("--predicate", help="module:function deciding per call [KDUMP_PREDICATE].")
@click.option("--max-bundles", type=int, help="Bundles per process at most [KDUMP_MAX_BUNDLES].")
@click.option("--max-bytes", help="Bytes per process at most, e.g. 20G [KDUMP_MAX_BYTES].")
@click.option(
    "--keep", type=click.Choice(["oldest", "newest"]), help="Which bundles survive [KDUMP_KEEP]."
)
@click.option(
    "--on-exception/--no-on-exception",
    default=None,
    help="Dump calls that raise (snapshots every call: costly) [KDUMP_ON_EXCEPTION].",
)
@click.option("--outputs", help="default | none | all | names,positions [KDUMP_OUTPUTS].")
@click.option("--flush-signal", help="Signal that flushes, e.g. USR1 [KDUMP_FLUSH_SIGNAL].")
@click.option("--log", "log_file", type=click.Path(), help="kdump's log file [KDUMP_LOG].")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def command(cmd: tuple[str, ...], targets: tuple[str, ...], **opts: Any) -> int:
    """Run CMD with recording active in CMD's process and every Python process it starts
    (multiprocessing spawn / fork workers included). Exits with CMD's exit code."""
    from kdump.errors import UsageError
    from kdump.record.session import RecordConfig

    env = build_env(dict(os.environ), targets, opts)
    cfg = RecordConfig.from_env(env)  # validate here: a bad option is one line, exit 2
    if cfg.mode == "ring":
        raise UsageError(
            "recording mode 'ring' (the flight recorder) is not available yet; use --mode sync"
        )
    from kdump.record.hooks import parse_targets

    parse_targets(list(cfg.targets))
    if opts.get("flush_signal"):
        from kdump.record.startup import signal_number

        signal_number(opts["flush_signal"])
    out = Path(cfg.out)
    started = time.time()
    rc = run(list(cmd), env)
    summarize(out, started, cfg.targets)
    return rc


_OPTION_VARS = {
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


def build_env(
    base: dict[str, str], targets: tuple[str, ...], opts: dict[str, Any]
) -> dict[str, str]:
    """CMD's environment: options become KDUMP_* variables; the startup folder leads PYTHONPATH."""
    env = dict(base)
    env["KDUMP_RECORD"] = "1"
    if targets:
        env["KDUMP_TARGETS"] = ",".join(targets)
    for key, var in _OPTION_VARS.items():
        value = opts.get(key)
        if value is not None:
            env[var] = str(Path(value).resolve()) if key in ("out", "log_file") else str(value)
    if opts.get("on_exception") is not None:
        env["KDUMP_ON_EXCEPTION"] = "1" if opts["on_exception"] else "0"
    out = env.get("KDUMP_OUT") or config.get("KDUMP_OUT", env) or "kdump-out"
    env["KDUMP_OUT"] = str(Path(out).resolve())  # children may chdir
    paths = [str(STARTUP_DIR)]  # holds only sitecustomize.py, which takes itself off sys.path
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    return env


def run(cmd: list[str], env: dict[str, str]) -> int:
    """Run CMD; SIGTERM / SIGINT sent to kdump go to CMD; CMD's exit code comes back
    (death by signal n -> 128 + n, as shells report it)."""
    try:
        proc = subprocess.Popen(cmd, env=env)
    except FileNotFoundError:
        from kdump.errors import UsageError

        raise UsageError(f"command not found: {cmd[0]}")

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


def summarize(out: Path, since: float, targets: tuple[str, ...]) -> None:
    """What the run wrote, and the exact next command."""
    bundles = []
    if out.is_dir():
        for p in out.rglob("*.kdump"):
            if "blobs" in p.parts:
                continue
            try:
                if p.stat().st_mtime >= since - 1:
                    bundles.append(p)
            except OSError:
                continue
    bundles.sort(key=lambda p: (p.parent.name, p.name))
    if not bundles:
        click.echo(
            f"kdump: no calls were recorded (targets: {', '.join(targets) or 'deep_gemm'}); check "
            "that the program calls them, and the trigger options",
            err=True,
        )
        return
    folders = sorted({p.parent for p in bundles})
    store = out / "blobs"
    nbytes = sum(p.stat().st_size for p in bundles)
    blob_bytes = (
        sum(b.stat().st_size for b in store.rglob("*") if b.is_file()) if store.is_dir() else 0
    )
    for f in folders:
        if (f / "blobs").is_dir():
            blob_bytes += sum(b.stat().st_size for b in (f / "blobs").rglob("*") if b.is_file())
    click.echo(
        f"kdump: wrote {len(bundles)} bundle(s), {human_bytes(nbytes + blob_bytes)} "
        f"(shared blobs included) in {len(folders)} process folder(s) under {out}:",
        err=True,
    )
    for f in folders:
        n = sum(1 for p in bundles if p.parent == f)
        click.echo(f"  {f}  ({n} bundle(s), index: {f / 'index.json'})", err=True)
    click.echo(f"next: kdump replay {bundles[0]}", err=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(command())
