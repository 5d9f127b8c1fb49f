"""Activation of recording at interpreter start (`kdump record`'s processes).

`kdump/record/_startup/sitecustomize.py` calls `activate()` when KDUMP_RECORD=1. It reads the
configuration from the environment (kdump.config), patches the targets (now, or when their module
is imported: nothing is imported here, so startup stays cheap and torch-free), and installs the
flush points: atexit, SIGTERM and SIGINT (each chained to the handler that was there before, and
the signal is not swallowed), and an optional flush signal (KDUMP_FLUSH_SIGNAL, e.g. USR1) that
flushes without stopping the process. Forked children re-initialise their per-process state
through the session's at-fork hook. Every recorder flushes through the same points
(`Recorder.flush`).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from kdump import config
from kdump.errors import UsageError
from kdump.log import log

_session: Any = None


def activate(env: Any = None) -> Any:
    """Start recording in this process from the environment; idempotent; never raises."""
    global _session
    if _session is not None:
        return _session
    try:
        from kdump.record.config import RecordConfig
        from kdump.record.session import Recording

        cfg = RecordConfig.from_env(env)
        _session = Recording(cfg).start()
        _install_signals(config.get("KDUMP_FLUSH_SIGNAL", env))
    except UsageError as exc:
        log(f"recording not started: {exc}")
    except Exception as exc:
        log(f"recording not started (internal error: {type(exc).__name__}: {exc})")
    return _session


def signal_number(name: str) -> int:
    """'USR1', 'SIGUSR1' or '10' -> the signal number."""
    text = name.strip().upper()
    if text.isdigit():
        return int(text)
    if not text.startswith("SIG"):
        text = "SIG" + text
    sig = getattr(signal, text, None)
    if not isinstance(sig, int):
        raise UsageError(f"unknown signal {name!r} (use e.g. USR1)")
    return int(sig)


def _flush() -> None:
    from kdump.record.session import flush_all

    flush_all()


def _install_signals(flush_signal: str | None) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    for sig in (signal.SIGTERM, signal.SIGINT):
        _chain(sig, stop=True)
    if flush_signal:
        _chain(signal_number(flush_signal), stop=False)


def _chain(sig: int, *, stop: bool) -> None:
    """Flush on `sig`, then do what the previous handler would have done."""
    try:
        previous = signal.getsignal(sig)
    except (ValueError, OSError):
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        try:
            _flush()
        except Exception:
            pass
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL and stop:
            # Die of the same signal, as the program would have without kdump.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # SIG_IGN, or the flush signal's default (terminate): do nothing more

    try:
        signal.signal(sig, handler)
    except (ValueError, OSError) as exc:
        log(f"cannot install a handler for signal {sig}: {exc}")
