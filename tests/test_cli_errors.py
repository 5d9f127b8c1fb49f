"""One classification of errors at the CLI's boundary: the user's environment is exit 2 with one
line, an interruption 130, only kdump's own bugs 70; `-v` anywhere before `--`; `--json` gives
one strict JSON object for every outcome."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from pathlib import Path

import click
import pytest
import torch

from kdump.bundle import capture_call, save_calls
from kdump.cli import main
from kdump.cli.common import check_output_path, dumps_strict, run_cli
from kdump.errors import EXIT_INTERRUPTED, UserEnvironmentError, environment_error

ROOT = Path(__file__).parent.parent
SAMPLE = ROOT / "captures" / "contiguous_ue8m0.kdump"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def run_group(
    capsys: pytest.CaptureFixture[str], exc: BaseException, *argv: str
) -> tuple[int, str, str]:
    """A one-command group whose command raises `exc`, run through the CLI's boundary."""

    @click.group()
    @click.option("-v", "--verbose", is_flag=True)
    def group(verbose: bool) -> None:
        pass

    @group.command("boom")
    @click.option("--json", "as_json", is_flag=True)
    @click.argument("rest", nargs=-1)
    def boom(as_json: bool, rest: tuple[str, ...]) -> None:
        raise exc

    with pytest.raises(SystemExit) as got:
        run_cli(group, list(argv))
    out, err = capsys.readouterr()
    return int(got.value.code or 0), out, err


@pytest.fixture
def nan_bundle(tmp_path: Path) -> Path:
    rec = capture_call(
        "deep_gemm:m_grouped",
        [torch.ones(3)],
        {},
        names=["a"],
        meta={"x": float("nan"), "y": float("inf"), "z": -float("inf")},
    )
    return save_calls(tmp_path / "nan.kdump", [rec], env={"hostname": "h"})


# --- the user's environment is exit 2, one line -------------------------------------------


@pytest.mark.parametrize(
    "code",
    [errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EISDIR, errno.ENOTDIR],
)
def test_environment_oserrors_are_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], code: int
) -> None:
    exc = OSError(code, os.strerror(code), "/data/out/report.md")
    rc, _, err = run_group(capsys, exc, "boom")
    assert rc == 2, err
    assert "internal error" not in err and "report it" not in err
    assert err.count("\n") == 1 and err.startswith("kdump: error: ")
    assert "'/data/out/report.md'" in err


def test_each_environment_line_says_what_to_do() -> None:
    for code, words in [
        (errno.EACCES, "permissions"),
        (errno.ENOSPC, "free some space"),
        (errno.EROFS, "writable location"),
        (errno.ENOENT, "create its folder"),
        (errno.EISDIR, "give a file name"),
    ]:
        typed = environment_error(OSError(code, os.strerror(code), "x"))
        assert isinstance(typed, UserEnvironmentError) and typed.exit_code == 2
        assert words in str(typed) and "\n" not in str(typed)


def test_subclasses_of_oserror_are_classified_by_errno() -> None:
    assert environment_error(PermissionError(errno.EACCES, "denied", "f")) is not None
    assert environment_error(IsADirectoryError(errno.EISDIR, "is a dir", "f")) is not None
    assert environment_error(NotADirectoryError(errno.ENOTDIR, "not a dir", "f")) is not None
    assert environment_error(FileNotFoundError(errno.ENOENT, "missing", "f")) is not None
    assert environment_error(OSError(errno.EXDEV, "cross-device link")) is None
    assert environment_error(OSError("no errno at all")) is None


def test_other_oserrors_and_bugs_stay_internal(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_group(capsys, OSError(errno.EXDEV, "Invalid cross-device link"), "boom")
    assert rc == 70 and "internal error: OSError" in err and "report it" in err
    rc, _, err = run_group(capsys, ValueError("a bug"), "boom")
    assert rc == 70 and "internal error: ValueError: a bug" in err


def test_interrupt_is_130(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_group(capsys, KeyboardInterrupt(), "boom")
    # (click ends the ^C line first)
    assert rc == EXIT_INTERRUPTED == 130 and err.strip() == "kdump: interrupted" and out == ""
    rc, out, _ = run_group(capsys, KeyboardInterrupt(), "boom", "--json")
    assert rc == 130 and json.loads(out) == {"error": "interrupted", "exit_code": 130}


def test_unwritable_report_output_is_a_user_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the system answers on a folder the user cannot write (tested as root too: the write
    itself is made to fail as it does for an ordinary user)."""
    out = tmp_path / "r.md"
    real = Path.write_text

    def denied(self: Path, *args: object, **kwargs: object) -> int:
        if self == out:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", denied)
    rc, _, err = run(capsys, "report", str(SAMPLE), "-o", str(out), "--no-plot")
    assert rc == 2, err
    assert "permission denied" in err and "internal error" not in err
    assert err.strip().count("\n") == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_read_only_folder_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for argv in (
            ["report", str(SAMPLE), "-o", str(ro / "r.md")],
            ["report", str(SAMPLE), "--script", str(ro / "repro.py")],
            ["slim", str(SAMPLE), "-o", str(ro / "s.kdump")],
        ):
            rc, _, err = run(capsys, *argv)
            assert rc == 2 and "permission denied" in err, argv
    finally:
        ro.chmod(0o755)


def test_output_checks_say_what_is_wrong(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UserEnvironmentError, match="is a file, not a folder"):
        check_output_path(afile / "r.md")
    with pytest.raises(UserEnvironmentError, match=r"does not exist: create it first \(mkdir -p"):
        check_output_path(tmp_path / "no" / "such" / "r.md")
    with pytest.raises(UserEnvironmentError, match="is a folder: give a file name"):
        check_output_path(tmp_path)
    check_output_path(tmp_path / "fine.md")  # a writable folder: no error
    check_output_path(afile)  # an existing file is overwritten


def test_slim_and_report_refuse_a_missing_folder_before_replaying(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for argv in (
        ["slim", str(SAMPLE), "-o", str(tmp_path / "nodir" / "s.kdump")],
        ["report", str(SAMPLE), "--replay", "-o", str(tmp_path / "nodir" / "r.md")],
        ["report", str(SAMPLE), "--script", str(tmp_path / "nodir" / "repro.py")],
    ):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and "does not exist" in err and out == "", argv
    assert not (tmp_path / "nodir").exists()


def test_pack_into_a_path_below_a_file_is_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("x")
    rc, _, err = run(capsys, "pack", str(SAMPLE), "-o", str(tmp_path / "afile" / "x.kdump"))
    assert rc == 2 and "internal error" not in err, err


# --- -v anywhere before `--` -------------------------------------------------------------------


def test_verbose_after_the_subcommand(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    bad = str(tmp_path / "afile" / "x.kdump")
    for argv in (["pack", str(SAMPLE), "-o", bad, "-v"], ["-v", "pack", str(SAMPLE), "-o", bad]):
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and "No such option" not in err, err
        assert "Traceback (most recent call last)" in err
    for cmd in ("info", "diff", "report", "slim", "doctor", "salvage", "record", "replay"):
        rc, out, err = run(capsys, cmd, "--help")
        assert rc == 0 and "-v, --verbose" in out, cmd


def test_verbose_after_dashdash_belongs_to_the_program(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_group(capsys, ValueError("a bug"), "boom", "--", "python", "-v")
    assert rc == 70 and "Traceback" not in err
    rc, _, err = run_group(capsys, ValueError("a bug"), "-v", "boom", "--", "x")
    assert rc == 70 and "Traceback (most recent call last)" in err


# --- --json: one strict JSON object for every outcome -------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["info", "--json", "MISSING"],
        ["diff", "--json", "MISSING", "MISSING"],
        ["slim", "--json", "MISSING", "-o", "OUT"],
        ["info", "--json", "--no-such-option"],
    ],
)
def test_json_errors_are_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    argv = [str(tmp_path / a) if a in ("MISSING", "OUT") else a for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    doc = json.loads(out)
    assert set(doc) == {"error", "exit_code"} and doc["exit_code"] == 2 and doc["error"]
    assert err == ""


def test_json_internal_error_is_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_group(capsys, RuntimeError("bug"), "boom", "--json")
    assert rc == 70
    doc = json.loads(out)
    assert doc["exit_code"] == 70 and "RuntimeError: bug" in doc["error"]


def _strict_load(text: str) -> object:
    def refuse(token: str) -> float:
        raise AssertionError(f"non-standard JSON number {token}")

    return json.loads(text, parse_constant=refuse)


def test_info_and_diff_json_are_strict(
    capsys: pytest.CaptureFixture[str], nan_bundle: Path
) -> None:
    rc, out, _ = run(capsys, "info", "--json", str(nan_bundle))
    assert rc == 0
    [rep] = _strict_load(out)  # type: ignore[misc]
    meta = rep["calls"][0]["meta"]
    assert (meta["x"], meta["y"], meta["z"]) == ("NaN", "Infinity", "-Infinity")
    other = nan_bundle.with_name("other.kdump")
    shutil.copy(nan_bundle, other)
    rc, out, _ = run(capsys, "diff", "--json", str(nan_bundle), str(other))
    assert rc == 0 and isinstance(_strict_load(out), dict)


def test_dumps_strict() -> None:
    import numpy as np

    doc = {
        "a": [float("nan"), float("inf"), -math.inf, 1.5],
        "b": (np.float64("nan"), np.float32(2.0), torch.tensor([math.inf, 0.5])),
        "c": "\x1b[2J",
        1.5: "float key",
    }
    got = _strict_load(dumps_strict(doc))
    assert got == {
        "a": ["NaN", "Infinity", "-Infinity", 1.5],
        "b": ["NaN", 2.0, ["Infinity", 0.5]],
        "c": "\x1b[2J",
        "1.5": "float key",
    }
    assert "\x1b" not in dumps_strict(doc)  # escaped as \u001b


FULL = Path("/dev/full")  # every write fails with ENOSPC


@pytest.mark.skipif(not FULL.is_char_device(), reason="needs Linux's /dev/full")
def test_full_disk_is_exit_2_naming_the_output(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "report", str(SAMPLE), "-o", str(FULL), "--no-plot")
    assert rc == 2 and "no space left on the device of '/dev/full'" in err, err
    # a file renamed over its path must not replace a device
    rc, _, err = run(capsys, "report", str(SAMPLE), "--script", str(FULL))
    assert rc == 2 and "is not a regular file" in err
    rc, _, err = run(capsys, "slim", str(SAMPLE), "-o", str(FULL))
    assert rc == 2 and "is not a regular file" in err
    assert FULL.is_char_device()


@pytest.mark.skipif(not FULL.is_char_device(), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_stdout_on_a_full_disk_is_exit_2(json_flag: list[str]) -> None:
    import subprocess
    import sys

    with open(FULL, "w") as full:
        got = subprocess.run(
            [sys.executable, "-m", "kdump", "info", str(SAMPLE), *json_flag],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip() == (
        "kdump: error: no space left on the device of the output: free some space or write "
        "elsewhere"
    )
