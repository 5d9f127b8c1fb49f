"""`kdump record [options] -- CMD ...`: run CMD with recording active in all its processes."""

from __future__ import annotations

import sys
from typing import Any

import click

from kdump import config

EPILOG = (
    "\b\nExamples:\n"
    "  kdump record -- python -m sglang.launch_server --model-path M --tp 8\n"
    "  kdump record --ring-slots 256 --flush-signal USR1 -- python examples/moe_decode.py\n"
    "  kdump record --mode sync --calls 0-9 -- python serve.py\n"
    "  kdump record --cuda-coredump -- python serve.py\n"
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
@click.option(
    "--mode",
    type=click.Choice(["ring", "sync"]),
    help="ring: flight recorder, salvaged at exit (default); sync: a bundle per call [KDUMP_MODE].",
)
@click.option("--ring-slots", type=int, help="Calls the ring keeps per process [KDUMP_RING_SLOTS].")
@click.option("--slot-bytes", help="Bytes per ring slot, e.g. 1M [KDUMP_SLOT_BYTES].")
@click.option(
    "--device-bytes",
    help="GPU memory of the flight recorder per GPU (the journal's twin and the ring of gathered "
    "rows), e.g. 1G; 0 turns the device tier off [KDUMP_DEVICE_BYTES].",
)
@click.option(
    "--static-bytes",
    help="Host memory for weights copied once per version, e.g. 1G; 0 records them by "
    "reference [KDUMP_STATIC_BYTES].",
)
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
@click.option(
    "--salvage-process/--no-salvage-process",
    default=True,
    help="Mode ring: a process of kdump's that holds each recorded process' device tier and "
    "writes it when that process dies, also by SIGKILL or an illegal address (default: on) "
    "[KDUMP_SALVAGER].",
)
@click.option(
    "--cuda-coredump",
    is_flag=True,
    help="A GPU exception writes a GPU core dump per process into the output directory "
    "(cuda-coredump.HOST.PID.nvcudmp; salvaged bundles name it) [CUDA_COREDUMP_FILE].",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def command(cmd: tuple[str, ...], targets: tuple[str, ...], **opts: Any) -> int:
    """Run CMD with recording active in CMD's process and every Python process it starts
    (multiprocessing spawn / fork workers included). Exits with CMD's exit code."""
    from kdump.record.launcher import launch

    return launch(list(cmd), targets, opts, echo=lambda line: click.echo(line, err=True))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(command())
