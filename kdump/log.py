"""kdump's own log: one line per event, prefixed "kdump:", to KDUMP_LOG or stderr. Never raises."""

from __future__ import annotations

import sys
import threading

from kdump import config

_logged: set[str] = set()
_log_lock = threading.Lock()


def log(message: str) -> None:
    line = f"kdump: {message}\n"
    try:
        path = config.get("KDUMP_LOG")
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)
            return
    except Exception:
        pass  # fall back to stderr
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except Exception:
        pass


def log_once(key: str, message: str) -> None:
    """Log `message` the first time `key` is seen in this process."""
    with _log_lock:
        if key in _logged:
            return
        _logged.add(key)
    log(message)
