"""`kdump record` at its edges, with real subprocesses: a bad output folder stops it before the
program runs; a salvage that fails keeps the journals and says how to recover them; a target
module the program never imported is named; the printed `next:` command works as printed for a
user's own target; a second Ctrl-C stops waiting but still salvages; nothing is left behind after
a SIGKILL that `kdump salvage` does not clean."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kdump
from kdump.record import launcher

KDUMP_ROOT = str(Path(kdump.__file__).resolve().parent.parent)
KDUMP = [sys.executable, "-m", "kdump"]

MYMOD = """
import torch

def myfn(x):
    return x * 2
"""

SCRIPT = """
import os, signal, sys, time, torch
import mymod

mymod.myfn(torch.ones(4))
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "clobber-out":  # the output folder becomes a file: salvage at the end must fail
    import shutil
    shutil.rmtree(os.environ["KDUMP_OUT"])
    open(os.environ["KDUMP_OUT"], "w").close()
if what.startswith("sleep"):  # ignores Ctrl-C; notes its pid, then waits
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(os.path.join(os.path.dirname(__file__), "program.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(float(what[5:] or 60))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.fixture
def work(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A user's folder with their module and script (mymod is importable only from there), a
    private TMPDIR and journal folder, and no kdump config."""
    (tmp_path / "mymod.py").write_text(textwrap.dedent(MYMOD))
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    # a short TMPDIR: the salvage process' socket path must stay under 108 bytes
    short = Path(tempfile.mkdtemp(prefix="kd-", dir="/tmp"))
    (tmp_path / "tmp").symlink_to(short)
    (tmp_path / "shm").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDUMP_")}
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        PYTHONPATH=os.pathsep.join([KDUMP_ROOT, *old]),
        TMPDIR=str(short),
        KDUMP_JOURNAL_DIR=str(tmp_path / "shm"),
        KDUMP_CONFIG=str(tmp_path / "none.toml"),
    )
    yield tmp_path, env
    shutil.rmtree(short, ignore_errors=True)


def _record(work, *opts: str, arg: str = "", target: str = "mymod:myfn", **extra: str):
    tmp_path, env = work
    cmd = [*KDUMP, "record", "-t", target, *opts, "--", sys.executable, "script.py"]
    cmd += [arg] if arg else []
    return subprocess.run(
        cmd, cwd=tmp_path, env={**env, **extra}, capture_output=True, text=True, timeout=180
    )


def test_an_output_folder_that_is_a_file_stops_kdump_before_the_program(work) -> None:
    tmp_path, _ = work
    (tmp_path / "afile").write_text("mine")
    for out in ("afile", "afile/sub"):
        r = _record(work, "-o", out, arg="sleep0")
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "output folder" in lines[0] and out in lines[0], r.stderr
        assert not (tmp_path / "program.pid").exists()  # the program never ran
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("program_rc", ["0", "3"])
def test_a_salvage_that_fails_keeps_the_journals_and_says_how_to_recover(work, program_rc):
    tmp_path, env = work
    r = _record(work, "-o", "out", "--no-salvage-process", arg="clobber-out", EXIT=program_rc)
    assert r.returncode == (2 if program_rc == "0" else 3), r.stderr
    assert "cannot salvage kdump-journal-" in r.stderr
    assert "no calls were recorded" not in r.stderr
    recover = next(ln for ln in r.stderr.splitlines() if "recover them with: " in ln)
    command = shlex.split(recover.split("recover them with: ")[1])
    kept = Path(command[2])
    assert kept.parent == tmp_path / "shm" and list(kept.glob("kdump-journal-*"))
    # the printed command works once OTHER_FOLDER is a real folder
    command[-1] = str(tmp_path / "other")
    got = subprocess.run(
        [*KDUMP, *command[1:]], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
    assert list((tmp_path / "other").glob("journal-*-call-*.kdump"))
    assert not kept.exists()  # kdump salvage removed the emptied run folder


def test_a_target_module_never_imported_is_named(work) -> None:
    r = _record(work, "-o", "out", "--mode", "sync", target="nosuchmod:fn")
    assert r.returncode == 0, r.stderr
    assert "target module nosuchmod was never imported by the program" in r.stderr
    r = _record(work, "-o", "out", "--mode", "sync", target="mymod:nosuch")
    assert "target module mymod has no nosuch" in r.stderr, r.stderr
    assert "never imported" not in r.stderr


def test_the_next_line_works_as_printed_for_a_users_own_target(work) -> None:
    tmp_path, env = work
    r = _record(work, "-o", "out", "--mode", "sync")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("next: "))
    words = shlex.split(line[len("next: ") :])
    assert words[:2] == ["kdump", "replay"]
    assert words[words.index("--allow-target") + 1] == "mymod:myfn"
    assert words[words.index("--path") + 1] == str(tmp_path)
    # as printed, from another folder, with nothing else allowed or on the path
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    got = subprocess.run(
        [*KDUMP, *words[1:]], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stdout + got.stderr


def test_a_target_importable_anywhere_gets_no_path(work, monkeypatch) -> None:
    tmp_path, _ = work
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    status = launcher.RunStatus(
        rows=[
            {
                "target": "mymod:myfn",
                "id": "mymod:myfn",
                "module": "mymod",
                "state": "patched",
                "root": str(tmp_path),
            }
        ],
        processes=1,
    )
    got = launcher.next_command(Path("b.kdump"), status)
    assert got == "kdump replay b.kdump --allow-target mymod:myfn"
    monkeypatch.setenv("PYTHONPATH", "")
    got = launcher.next_command(Path("b.kdump"), status)
    assert got == f"kdump replay b.kdump --allow-target mymod:myfn --path {tmp_path}"


def test_a_glob_target_allows_what_it_expanded_to_once(work, monkeypatch) -> None:
    tmp_path, _ = work
    monkeypatch.setenv("PYTHONPATH", "")
    row = {"module": "tkern", "state": "patched", "root": str(tmp_path)}
    status = launcher.RunStatus(
        rows=[
            {**row, "target": "tkern:*", "id": "tkern:*"},
            {**row, "target": "tkern:add_kernel", "id": "tkern:add_kernel"},
            {**row, "target": "other:fn", "id": "other:fn", "module": "other"},
        ],
        processes=1,
    )
    got = launcher.next_command(Path("b.kdump"), status)
    want = f"kdump replay b.kdump --allow-target 'tkern:*' --path {tmp_path}"
    want += " --allow-target other:fn"
    assert got == want


def test_a_killed_writers_temporary_is_removed_at_the_end_of_the_run(work) -> None:
    tmp_path, _ = work
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], text=True, capture_output=True
    ).stdout.strip()
    from kdump.bundle.store import _host_tag

    blobs = tmp_path / "out" / "blobs"
    blobs.mkdir(parents=True)
    left = blobs / f".abc.{dead}@{_host_tag()}.0123456789ab.tmp"
    left.write_bytes(b"partial")
    r = _record(work, "-o", "out", "--mode", "sync")
    assert r.returncode == 0, r.stderr
    assert not left.exists()


def _wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def _start(work, *opts: str, arg: str) -> subprocess.Popen:
    tmp_path, env = work
    cmd = [*KDUMP, "record", "-t", "mymod:myfn", *opts, "--", sys.executable, "script.py", arg]
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,  # the program, still running, would hold a pipe open
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _program_pid(tmp_path: Path, proc: subprocess.Popen) -> int:
    noted = tmp_path / "program.pid"
    if not _wait_for(lambda: noted.exists() and noted.read_text(), 120):
        proc.kill()
        pytest.fail(proc.communicate()[1][-2000:])
    return int(noted.read_text())


def _alive(pid: int) -> bool:
    """True while `pid` exists and is no zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_second_ctrl_c_stops_waiting_and_still_salvages(work) -> None:
    tmp_path, _ = work
    proc = _start(work, "-o", "out", arg="sleep60")
    program = _program_pid(tmp_path, proc)
    try:
        proc.send_signal(signal.SIGINT)  # forwarded: the program ignores it
        time.sleep(1.0)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "stopped waiting for the program" in err
        assert "1 call(s) salvaged" in err, err
        assert list((tmp_path / "out").rglob("journal-*-call-*.kdump"))
        assert not list((tmp_path / "tmp").glob("kdump-salvager-*"))  # no helper folder
        assert not list((tmp_path / "shm").iterdir())  # the run folder went too
    finally:
        _kill(program)


def test_after_a_sigkill_of_kdump_nothing_stays_that_salvage_does_not_clean(work) -> None:
    tmp_path, env = work
    proc = _start(work, "-o", "out", arg="sleep60")
    program = _program_pid(tmp_path, proc)
    try:
        folders = list((tmp_path / "tmp").glob("kdump-salvager-*"))
        assert len(folders) == 1  # the salvage process' socket folder, while kdump runs
        proc.kill()
        proc.communicate()
        # the salvage process notices its parent is gone, writes and removes its folder
        assert _wait_for(lambda: not folders[0].exists(), 10), list(folders[0].iterdir())
    finally:
        _kill(program)
    assert _wait_for(lambda: not _alive(program), 10)
    got = subprocess.run(
        [*KDUMP, "salvage", str(tmp_path / "shm"), "-o", str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stderr
    assert list((tmp_path / "out").rglob("journal-*-call-*.kdump"))
    assert list((tmp_path / "shm").iterdir()) == []  # journals, status files, run folder: gone
