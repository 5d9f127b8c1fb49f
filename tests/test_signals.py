"""SIGINT / SIGTERM to `kdump replay` end every process kdump started for it (the replay worker in
its own session, the fresh-eager oracle that worker started) within a second and remove their
temporary folders. Real subprocesses, a private TMPDIR, a target that sleeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls

KDUMP_ROOT = str(Path(kdump.__file__).resolve().parent.parent)

# First call returns (the worker's eager run), every later one (the fresh-eager oracle in its own
# process) notes its pid and sleeps: a replay that is busy two processes deep.
TARGETS = """
import os, time

def _note(name):
    with open(os.path.join(os.environ["SIG_TEST_DIR"], name), "a") as f:
        f.write(f"{os.getpid()}\\n")

def sleeps(x, out):
    _note("sleeping")
    out.copy_(x * 2.0)
    time.sleep(600)

def sleeps_later(x, out):
    marker = os.path.join(os.environ["SIG_TEST_DIR"], "first")
    out.copy_(x * 2.0)
    if not os.path.exists(marker):
        open(marker, "w").close()
        return
    _note("sleeping")
    time.sleep(600)
"""


def _bundle(tmp_path: Path, fn: str) -> Path:
    g = torch.Generator().manual_seed(5)
    x, out = torch.randn(8, 4, generator=g), torch.zeros(8, 4)
    call = capture_call(f"sigtargets:{fn}", [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    out.copy_(x * 2.0)
    attach_outputs(call, live, [1])
    path = tmp_path / f"{fn}.kdump"
    save_calls(path, [call])
    return path


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone: it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def sandbox(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "sigtargets.py").write_text(textwrap.dedent(TARGETS))
    tmp = tmp_path / "tmpdir"  # the temporary folders kdump makes land here, and only here
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDUMP_")}
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        TMPDIR=str(tmp),
        SIG_TEST_DIR=str(tmp_path),
        KDUMP_CONFIG=str(tmp_path / "none.toml"),
        PYTHONPATH=os.pathsep.join([KDUMP_ROOT, *old]),
    )
    return tmp_path, env


def _start(sandbox: tuple[Path, dict[str, str]], fn: str, *opts: str) -> subprocess.Popen:
    tmp_path, env = sandbox
    bundle = _bundle(tmp_path, fn)
    cmd = [sys.executable, "-m", "kdump", "replay", str(bundle), "--device", "cpu"]
    cmd += ["--repeat", "1", "--halo", "0", "--allow-target", f"sigtargets:{fn}"]
    cmd += ["--path", str(tmp_path / "mods"), *opts]
    # a session of its own: the test signals kdump alone, as a terminal's Ctrl-C would
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )


def _sleeping_pid(tmp_path: Path, proc: subprocess.Popen) -> int:
    noted = tmp_path / "sleeping"
    if not _wait_for(lambda: noted.exists() and noted.read_text().strip(), 90):
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the target never ran: {err.decode(errors='replace')[-2000:]}")
    return int(noted.read_text().split()[0])


def _kdump_temporaries(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("kdump-"))


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_replay_worker_and_its_folder(sandbox, sig, code) -> None:
    tmp_path, _ = sandbox
    proc = _start(sandbox, "sleeps")
    worker = _sleeping_pid(tmp_path, proc)
    assert worker != proc.pid and _alive(worker)
    assert _kdump_temporaries(tmp_path / "tmpdir")  # the worker's folder, while it runs
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == code, err.decode(errors="replace")
    assert took < 2.0, took  # not the replay's --timeout: the worker was ended
    assert _wait_for(lambda: not _alive(worker), 1.0), "the replay worker outlived kdump"
    assert _kdump_temporaries(tmp_path / "tmpdir") == []


def test_sigint_ends_the_oracle_process_the_worker_started(sandbox) -> None:
    tmp_path, _ = sandbox
    proc = _start(sandbox, "sleeps_later", "--oracle", "fresh")
    oracle = _sleeping_pid(tmp_path, proc)  # two processes below kdump, each in its own session
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err.decode(errors="replace")
    assert time.monotonic() - sent < 2.0
    assert _wait_for(lambda: not _alive(oracle), 1.0), "the oracle process outlived kdump"
    assert _kdump_temporaries(tmp_path / "tmpdir") == []


def test_without_a_signal_the_same_replay_hangs_until_its_timeout(sandbox) -> None:
    """The control: the target really sleeps, so the ends above are the signal's doing."""
    tmp_path, _ = sandbox
    proc = _start(sandbox, "sleeps", "--timeout", "2", "--json")
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 3, err.decode(errors="replace")
    doc = json.loads(out)
    found = doc["verdicts"][0]["findings"] if "verdicts" in doc else doc["findings"]
    assert any(f["kind"] == "hang" for f in found), doc
    assert _kdump_temporaries(tmp_path / "tmpdir") == []
