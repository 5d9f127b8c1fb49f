"""A long-lived fuzz worker: reads cases (JSON lines) on stdin, answers one JSON line each.

Started once per campaign by `tests.fuzz.pool`; it limits its own address space (relative to its
size after `import torch`) and bounds every case with an alarm, so a case that allocates without
bound or hangs is reported instead of taking the machine down.
"""

from __future__ import annotations

import json
import resource
import shutil
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuzz.mutate import Case, build

CASE_SECONDS = 20
HEADROOM = 2 << 30


class CaseTimeout(Exception):
    pass


def _alarm(*_: Any) -> None:
    raise CaseTimeout(f"case ran past {CASE_SECONDS} s (a hang?)")


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def limit_memory() -> None:
    size = _vm_size()
    if size:
        resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, resource.RLIM_INFINITY))


def _kdump_error(exc: BaseException, stage: str) -> str:
    """A typed kdump error is a fine ending if it is exit 2 and one line."""
    from kdump.errors import ExitCode

    code = getattr(exc, "exit_code", None)
    assert code == ExitCode.USAGE, f"{stage}: {type(exc).__name__} exits {code}, not 2: {exc}"
    assert "\n" not in str(exc), f"{stage}: error message is not one line"
    assert "\x1b" not in str(exc), f"{stage}: error message holds a raw ESC byte"
    kind = getattr(exc, "kind", None)
    return f"{stage}: {kind.value if kind is not None else type(exc).__name__}"


def _cli(args: list[str]) -> tuple[int, str]:
    """`kdump ARGS` in process, exactly as run_cli maps endings to exit codes."""
    import click
    from click.testing import CliRunner

    from kdump.cli import cli
    from kdump.errors import KdumpError

    result = CliRunner().invoke(cli, args, standalone_mode=False, catch_exceptions=True)
    exc = result.exception
    if exc is None or (isinstance(exc, SystemExit) and not exc.code):
        code = 0
    elif isinstance(exc, KdumpError):
        _kdump_error(exc, "info")
        code = int(exc.exit_code)
    elif isinstance(exc, click.ClickException):
        code = 2
    else:
        tb = "".join(traceback.format_exception(exc)).strip().splitlines()[-1]
        raise AssertionError(f"kdump {' '.join(args[:2])} raised {tb}")
    out = result.output
    assert "Traceback" not in out, "info printed a traceback"
    assert "\x1b" not in out, "info printed a raw ESC byte"
    return code, out


def exercise(path: Path, as_json: bool) -> str:
    """Load, materialise on CPU, verify, then render with `kdump info --verify`."""
    from kdump.bundle import load_bundle
    from kdump.errors import KdumpError
    from kdump.format.dtypes import dtype_from_name

    try:
        b = load_bundle(path)
    except KdumpError as exc:
        ended = _kdump_error(exc, "load")
    else:
        ended = "ok"
        with b:
            for call in b.calls:
                try:
                    m = call.materialize("cpu")
                    assert len(m.tensors) == len(call.tensors)
                    for t, rec in zip(m.tensors, call.tensors):  # a load is a correct load
                        assert t.dtype == dtype_from_name(rec.dtype)
                        assert tuple(t.shape) == rec.shape and t.stride() == rec.stride
                    call.materialize_outputs("cpu")
                    assert len(call.tensor_names) >= len(call.tensors)
                except KdumpError as exc:
                    ended = _kdump_error(exc, "materialise")
            try:
                b.verify()
            except KdumpError as exc:
                ended += " / " + _kdump_error(exc, "verify")
    code, _ = _cli(["info", "--verify", *(["--json"] if as_json else []), str(path)])
    assert code in (0, 2), f"info exits {code}"
    return ended + f" / info {code}"


def save_failure(case: Case, bases: Path, failures: Path, why: str) -> Path:
    """Rebuild the case in the failures folder (regular files only) with a note naming it."""
    dest = failures / case.name
    build(case, bases, dest)
    for p in sorted(dest.rglob("*"), reverse=True):
        if not (p.is_file() or p.is_dir()) or p.is_symlink():
            p.unlink()
            p.with_name(p.name + ".was-special").write_text("a FIFO, device or link\n")
    (dest / "CASE.txt").write_text(f"{case.name}\n{why}\n")
    return dest


def main(bases: Path, failures: Path, scratch: Path) -> None:
    import torch  # noqa: F401 - loaded before the limit is taken

    import kdump.bundle.reader
    import kdump.cli.info  # noqa: F401

    limit_memory()
    signal.signal(signal.SIGALRM, _alarm)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        case = Case(**req["case"])
        reply: dict[str, Any] = {"id": req["id"]}
        try:
            path = build(case, bases, scratch)
            signal.alarm(CASE_SECONDS)
            try:
                reply["ended"] = exercise(path, req.get("json", False))
            finally:
                signal.alarm(0)
            reply["ok"] = True
        except BaseException as exc:  # every other ending is a finding
            if isinstance(exc, KeyboardInterrupt):
                raise
            last = "".join(traceback.format_exception(exc)).strip().splitlines()[-1]
            reply["ok"] = False
            reply["why"] = last[:500]
            try:
                reply["saved"] = str(save_failure(case, bases, failures, reply["why"]))
            except Exception as save_exc:
                reply["saved"] = f"(could not save: {save_exc})"
        shutil.rmtree(scratch, ignore_errors=True)
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
