"""SIGINT / SIGTERM to `kdump replay` end every process kdump started for it (the replay worker in
its own session, the fresh-eager oracle that worker started) within a second and remove their
temporary folders; so does a second Ctrl-C, and a kdump killed outright takes them with it. Real
subprocesses, a private TMPDIR, a target that sleeps.

The bounds are on what kdump does, not on the machine: how long after the signal the target's
process is gone and kdump has said its one line (its processes reaped, its folders removed), and
a loose one on its exit, which includes interpreter teardown (torch's takes seconds on a loaded
machine). kdump starts with SIGINT at its default, as a terminal's foreground job has it,
however pytest itself was started (a script's `pytest &` ignores SIGINT, and so would kdump)."""

from __future__ import annotations

import json
import os
import select
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

# Each target notes its pid and sleeps where it must: in the replay worker, or only in the
# fresh-eager oracle that worker starts (a replay busy two processes deep).
TARGETS = """
import os, time

def _note(name):
    with open(os.path.join(os.environ["SIG_TEST_DIR"], name), "a") as f:
        f.write(f"{os.getpid()}\\n")

def sleeps(x, out):
    _note("sleeping")
    out.copy_(x * 2.0)
    time.sleep(600)

def ignores_term(x, out):  # as a process stuck in a CUDA call would: only SIGKILL ends it
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleeps(x, out)

def sleeps_in_oracle(x, out):
    # Sleeps only in the fresh-eager oracle: the process a replay process started.
    out.copy_(x * 2.0)
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        if b"kdump.replay.child" in f.read():
            _note("sleeping")
            time.sleep(600)
"""


def _bundle(tmp_path: Path, fn: str, calls: int = 1) -> Path:
    """`calls` identical calls of `fn` (an earlier call of the same target and layout is what
    makes the last one's replay start a fresh-eager oracle)."""
    g = torch.Generator().manual_seed(5)
    x, out = torch.randn(8, 4, generator=g), torch.zeros(8, 4)
    records = []
    for _ in range(calls):
        call = capture_call(f"sigtargets:{fn}", [x, out], {}, names=["x", "out"])
        live = input_tensors(call, [x, out], {})
        out.copy_(x * 2.0)
        attach_outputs(call, live, [1])
        records.append(call)
    path = tmp_path / f"{fn}.kdump"
    save_calls(path, records)
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


# Runs kdump (argv[1:]) in this process, with SIGINT at its default (or ignored: argv[0] == "ign").
_EXEC = (
    "import os, signal, sys\n"
    "how = signal.SIG_IGN if sys.argv[1] == 'ign' else signal.SIG_DFL\n"
    "signal.signal(signal.SIGINT, how)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def _start(
    sandbox: tuple[Path, dict[str, str]], fn: str, *opts: str, sigint: str = "dfl", calls: int = 1
) -> subprocess.Popen:
    tmp_path, env = sandbox
    bundle = _bundle(tmp_path, fn, calls)
    cmd = [sys.executable, "-c", _EXEC, sigint, "-m", "kdump", "replay", str(bundle)]
    cmd += ["--device", "cpu", "--repeat", "1", "--halo", "0", "--allow-target", f"sigtargets:{fn}"]
    cmd += ["--path", str(tmp_path / "mods"), *opts]
    # a session of its own: the test signals kdump alone, as a terminal's Ctrl-C would
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )


class Watched:
    """What happened after the signal, in seconds from it: when each watched process was gone,
    when kdump wrote `line` on stderr, when it exited."""

    def __init__(self) -> None:
        self.gone: dict[int, float] = {}
        self.said: float | None = None
        self.exited: float | None = None
        self.out, self.err = b"", b""


def _watch(proc: subprocess.Popen, sent: float, pids: list[int], line: bytes) -> Watched:
    """Read kdump's output and watch `pids` until kdump exits (30 s at most)."""
    w = Watched()
    streams = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
    while time.monotonic() - sent < 30:
        now = time.monotonic() - sent
        w.gone.update({p: now for p in pids if p not in w.gone and not _alive(p)})
        if streams:
            ready, _, _ = select.select(list(streams), [], [], 0.01)
            for fd in ready:
                chunk = os.read(fd, 65536)
                name = streams[fd]
                setattr(w, name, getattr(w, name) + chunk)
                if not chunk:
                    del streams[fd]
            if w.said is None and line in w.err:
                w.said = time.monotonic() - sent
        else:
            time.sleep(0.01)
        if proc.poll() is not None and not streams:
            w.exited = time.monotonic() - sent
            break
    if w.exited is None:
        proc.kill()
        proc.wait()
        pytest.fail(f"kdump did not exit within 30 s of the signal: {w.err[-2000:]!r}")
    w.gone.update({p: w.exited for p in pids if p not in w.gone and not _alive(p)})
    return w


def _check_prompt(w: Watched, pids: list[int]) -> None:
    for p in pids:  # ended by the signal, not by the target (600 s) or the replay's --timeout
        assert p in w.gone, f"process {p} outlived kdump"
        assert w.gone[p] < 2.0, (p, w.gone[p])
    assert w.said is not None and w.said < 2.0, (w.said, w.err[-2000:])
    assert w.exited < 20.0, w.exited  # interpreter teardown only


def _sleeping_pid(tmp_path: Path, proc: subprocess.Popen) -> int:
    noted = tmp_path / "sleeping"
    if not _wait_for(lambda: noted.exists() and noted.read_text().strip(), 90):
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the target never ran: {err.decode(errors='replace')[-2000:]}")
    return int(noted.read_text().split()[0])


def _kdump_temporaries(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("kdump-"))


ORACLE = ("sleeps_in_oracle", "--call", "1", "--oracle", "fresh")
LINES = {signal.SIGINT: b"kdump: interrupted", signal.SIGTERM: b"kdump: terminated"}


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_replay_worker_and_its_folder(sandbox, sig, code) -> None:
    tmp_path, _ = sandbox
    proc = _start(sandbox, "sleeps")
    worker = _sleeping_pid(tmp_path, proc)
    assert worker != proc.pid and _alive(worker)
    assert _kdump_temporaries(tmp_path / "tmpdir")  # the worker's folder, while it runs
    sent = time.monotonic()
    proc.send_signal(sig)
    w = _watch(proc, sent, [worker], LINES[sig])
    assert proc.returncode == code, w.err.decode(errors="replace")
    _check_prompt(w, [worker])
    assert _kdump_temporaries(tmp_path / "tmpdir") == []


def test_sigint_ends_the_oracle_process_the_worker_started(sandbox) -> None:
    tmp_path, _ = sandbox
    proc = _start(sandbox, *ORACLE, calls=2)
    oracle = _sleeping_pid(tmp_path, proc)  # two processes below kdump, each in its own session
    worker = _children(proc.pid)
    assert len(worker) == 1 and oracle in _children(worker[0]), (worker, oracle)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    w = _watch(proc, sent, [worker[0], oracle], LINES[signal.SIGINT])
    assert proc.returncode == 130, w.err.decode(errors="replace")
    _check_prompt(w, [worker[0], oracle])
    assert _kdump_temporaries(tmp_path / "tmpdir") == []


def test_a_second_ctrl_c_does_not_cut_the_first_one_short(sandbox) -> None:
    """The worker ignores SIGTERM, so the first Ctrl-C's handler waits out its grace before the
    SIGKILL; a second Ctrl-C meanwhile must not end kdump before that SIGKILL."""
    tmp_path, _ = sandbox
    proc = _start(sandbox, "ignores_term")
    worker = _sleeping_pid(tmp_path, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.15)  # within the 0.5 s grace (on a slow machine the two may come as one)
    proc.send_signal(signal.SIGINT)
    w = _watch(proc, sent, [worker], LINES[signal.SIGINT])
    assert proc.returncode == 130, w.err.decode(errors="replace")
    _check_prompt(w, [worker])
    assert _kdump_temporaries(tmp_path / "tmpdir") == []


def test_a_kdump_killed_outright_takes_its_processes_with_it(sandbox) -> None:
    """No handler runs on SIGKILL: the worker and the oracle it started die with their parents
    (a folder is left: nothing of kdump's ran to remove it)."""
    tmp_path, _ = sandbox
    proc = _start(sandbox, *ORACLE, calls=2)
    oracle = _sleeping_pid(tmp_path, proc)
    (worker,) = _children(proc.pid)
    proc.kill()
    _watch(proc, time.monotonic(), [], b"")
    assert proc.returncode == -signal.SIGKILL
    assert _wait_for(lambda: not _alive(worker) and not _alive(oracle), 5.0), "they outlived it"


def test_a_sigint_that_was_ignored_at_start_stays_ignored(sandbox) -> None:
    """As Python and every POSIX program: a script's `kdump replay ... &` starts with SIGINT
    ignored (so that a Ctrl-C meant for the foreground spares it); SIGTERM still ends it."""
    tmp_path, _ = sandbox
    proc = _start(sandbox, "sleeps", sigint="ign")
    worker = _sleeping_pid(tmp_path, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert proc.poll() is None and _alive(worker)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    w = _watch(proc, sent, [worker], LINES[signal.SIGTERM])
    assert proc.returncode == 143, w.err.decode(errors="replace")
    _check_prompt(w, [worker])
    assert _kdump_temporaries(tmp_path / "tmpdir") == []


# A signal inside the registry's section: handled as the section ends. A handler that ran at
# once would wait forever for the lock the interrupted code holds.
_SECTION = """
import os, signal, time
from pathlib import Path
from kdump.replay import procs
signal.signal(signal.SIGINT, signal.SIG_DFL)  # a suite started as `pytest &` ignores SIGINT
procs.install_signal_handlers(0.1)
folder = procs.make_temp("kdump-section-")
try:
    with procs._registry():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)  # the handler's chance comes here: it must wait for the section's end
        print("section ended", flush=True)
except KeyboardInterrupt:
    print("interrupted after it", Path(folder).exists(), flush=True)
"""


def test_a_signal_inside_the_registry_section_waits_for_its_end(sandbox) -> None:
    tmp_path, env = sandbox
    got = subprocess.run(
        [sys.executable, "-c", _SECTION], env=env, capture_output=True, text=True, timeout=60
    )
    assert got.stdout.split("\n")[:2] == ["section ended", "interrupted after it False"], got
    assert _kdump_temporaries(tmp_path / "tmpdir") == []


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


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
