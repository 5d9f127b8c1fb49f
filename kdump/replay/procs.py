"""The processes and temporary folders kdump starts for replays, and how SIGINT / SIGTERM end
them.

Every process started here runs in a session of its own (a hang kills the whole group: a
sanitizer's child too) and is registered, with the folders made for it, until it is reaped.
SIGINT and SIGTERM end them all (`end_children`: SIGTERM to each group, SIGKILL after GRACE_S)
and remove the folders before kdump stops: SIGINT then goes on as KeyboardInterrupt (exit 130),
SIGTERM as exit 143. A replay child does the same for the processes it started (the
fresh-eager oracle), then exits at once.

Each rule below closes a way for a process to outlive kdump, or for kdump to hang, that only
shows when the timing is unlucky (a loaded machine, a quick second Ctrl-C):

- The handler never breaks into the main thread's registry sections (`_unbroken`): a signal
  that arrives inside one is handled as the section ends. Otherwise the handler would wait
  forever for the lock the code it interrupted holds, or a process started but not yet
  registered would never be ended.
- A second signal while the first is handled waits for it: it must not cut short the SIGKILL
  that follows the grace (a process stuck in a CUDA call ignores the SIGTERM).
- A replay child started directly (not under a wrapper such as compute-sanitizer) dies with the
  process that started it (`die_with_parent`, Linux): when kdump or a replay worker is killed
  outright, or the worker's own handler comes too late on a loaded machine, the oracle it
  started does not live on in its session.
- The folders a replay child makes lie inside the folder its parent made for it
  (`nest_temps_in`): the parent's removal takes them too, however the child ended.
- A replay child, once SIGTERM's SystemExit has unwound its stack (its `finally` and `with`
  blocks remove what it made), ends with os._exit (kdump.replay.child.main): interpreter
  teardown (torch's takes most of a second on a loaded machine) would outlast the parent's
  grace and end in SIGKILL.

A signal that was ignored when kdump started stays ignored, as Python itself leaves it: a shell
starts the background commands of a script (`cmd &` without job control) with SIGINT and SIGQUIT
ignored, so that a Ctrl-C meant for the foreground does not reach them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

GRACE_S = 0.5  # SIGTERM, then this long for a group's processes to clean up, then SIGKILL
CHILD_GRACE_S = 0.2  # the same inside a replay child, for its own children (within GRACE_S)
TERM_EXIT = 128 + signal.SIGTERM
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_live_lock = threading.Lock()
_live: dict[int, subprocess.Popen[Any]] = {}  # process group id (= pid) -> its leader
_live_dirs: set[str] = set()
_ending = threading.Event()
_temp_parent: list[str] = []  # where a replay child makes its folders: its parent's folder

# The main thread's depth in registry sections (only the main thread changes it, and the handler
# runs in the main thread), and the handling a signal that came inside one is owed.
_depth = 0
_owed: list[Callable[[], None]] = []


class Interrupted(KeyboardInterrupt):
    """kdump is ending (SIGINT or SIGTERM): no new replay process starts."""


@contextlib.contextmanager
def _unbroken() -> Iterator[None]:
    """A section of the main thread that SIGINT / SIGTERM does not break into: a signal that
    comes meanwhile is handled when the outermost section ends. Other threads need none (the
    handler runs in the main thread and waits for their lock)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _owed:
            handle = _owed[-1]
            _owed.clear()
            handle()


@contextlib.contextmanager
def _registry() -> Iterator[None]:
    with _unbroken(), _live_lock:
        yield


def spawn(cmd: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """Popen in a new session (so a group kill reaches a sanitizer's child too), registered
    until `forget`. Started and registered in one unbroken section."""
    if _ending.is_set():
        raise Interrupted
    install_signal_handlers()
    with _unbroken():
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        with _registry():
            _live[proc.pid] = proc
    if _ending.is_set():  # the signal came (in another thread) while it started: it goes too
        end_children()
        raise Interrupted
    return proc


def forget(proc: subprocess.Popen[Any]) -> None:
    with _registry():
        _live.pop(proc.pid, None)


def nest_temps_in(folder: Path) -> None:
    """This process (a replay child) makes its temporary folders inside `folder`, the one its
    parent made and removes."""
    _temp_parent[:] = [str(folder)]


def make_temp(prefix: str) -> Path:
    with _registry():
        folder = tempfile.mkdtemp(prefix=prefix, dir=_temp_parent[0] if _temp_parent else None)
        _live_dirs.add(folder)
    return Path(folder)


@contextlib.contextmanager
def temp_folder(prefix: str) -> Iterator[Path]:
    """A registered temporary folder for the `with` block: a signal's end removes it too, and
    in a replay child it lies inside the parent's folder (removed with it even after a
    SIGKILL), which a tempfile.TemporaryDirectory would not."""
    folder = make_temp(prefix)
    try:
        yield folder
    finally:
        remove_temp(folder)


def remove_temp(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    with _registry():
        _live_dirs.discard(str(folder))


def end_children(grace: float = GRACE_S) -> None:
    """End every registered process group (SIGTERM, then SIGKILL after `grace` seconds), reap
    the leaders and remove the registered folders; no new one starts afterwards. Safe to call
    from a signal handler and more than once."""
    _ending.set()
    with _registry():
        procs = list(_live.values())
        _live.clear()
        folders = list(_live_dirs)
        _live_dirs.clear()
    for p in procs:
        signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except (subprocess.TimeoutExpired, OSError):
            pass
    for p in procs:  # also what a leader that exited left running in its group
        signal_group(p.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=1.0)
        except (subprocess.TimeoutExpired, OSError):
            pass
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def install_signal_handlers(grace: float = GRACE_S) -> None:
    """On SIGINT and SIGTERM, end the registered processes first (main thread only; a signal
    that is ignored stays ignored). SIGINT then does what it did before (KeyboardInterrupt by
    default); SIGTERM calls the previous handler, or exits with 143 through SystemExit, so
    `finally` blocks (temporary folders) still run."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if previous == signal.SIG_IGN or getattr(previous, "_kdump_ends_children", False):
            continue
        try:
            signal.signal(sig, _handler(previous, grace))
        except (ValueError, OSError):
            continue


def _handler(previous: Any, grace: float) -> Any:
    def handler(signum: int, frame: Any) -> None:
        if _depth > 0:  # inside a registry section, or while an earlier signal is handled
            _owed.append(lambda: handler(signum, None))
            return  # PEP 475: a call it interrupted goes on; the section is short
        with _unbroken():
            end_children(grace)
        if callable(previous):
            previous(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write("kdump: terminated\n")
            raise SystemExit(TERM_EXIT)

    handler._kdump_ends_children = True  # type: ignore[attr-defined]
    return handler


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when the thread that started it ends (Linux's
    parent-death signal), and end at once if `parent` is already gone (it ended before the
    request took effect). Elsewhere, or where prctl is refused, nothing changes: the parent's
    handler still ends this process's group."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent and not _exists(parent):
        os._exit(TERM_EXIT)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
