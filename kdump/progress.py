"""Progress of long CLI work (replaying a folder, packing, writing and salvaging bundles): one
small API.

`with progress(label, total) as bar: ... bar.advance()`. On a terminal (stderr is a TTY) it is a
rich bar that disappears when done; otherwise (logs, CI, pipes) plain lines on stderr, at most
one per PLAIN_INTERVAL_S seconds or per tenth of the total, plus the last one, never an escape
sequence; with `enabled=False` (--quiet, --json) nothing at all. Progress goes to stderr so that
stdout stays the command's result.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from kdump.text import markup, visible

PLAIN_INTERVAL_S = 5.0  # a plain line at most this often, unless a tenth of the work is done
PLAIN_FRACTION = 0.1
BIG_BYTES = 64 << 20  # writing one bundle of fewer bytes ends before a bar would tell anything


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}"


class Bar:
    """What the caller advances; the output is the subclass's business. `nbytes`: the steps are
    bytes (shown in MB)."""

    def __init__(self, label: str, total: int | None, nbytes: bool = False) -> None:
        self.label = label
        self.total = total  # may be set later, once known
        self.nbytes = nbytes
        self.done = 0
        self._lock = threading.Lock()  # replays of several GPUs advance from their threads

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            self._update()

    def _update(self) -> None:
        pass

    def _finish(self) -> None:
        pass


class _PlainBar(Bar):
    def __init__(
        self,
        label: str,
        total: int | None,
        stream: TextIO,
        clock: Callable[[], float],
        nbytes: bool = False,
        quiet_for: float = 0.0,
    ) -> None:
        super().__init__(label, total, nbytes)
        self._stream = stream
        self._clock = clock
        self._last_time = clock()
        self._last_done = 0
        self._quiet_until = self._last_time + quiet_for
        self._said = False

    def _line(self) -> str:
        label = visible(self.label, 200)
        done, total, unit = str(self.done), str(self.total), ""
        if self.nbytes:
            done, total, unit = _mb(self.done), _mb(self.total or 0), " MB"
        if self.total:
            return f"{label}: {done}/{total}{unit} ({100 * self.done // self.total}%)"
        return f"{label}: {done}{unit}"

    def _emit(self) -> None:
        self._said = True
        try:
            self._stream.write(self._line() + "\n")
            self._stream.flush()
        except Exception:  # progress never breaks the work it reports
            pass
        self._last_time = self._clock()
        self._last_done = self.done

    def _update(self) -> None:
        now = self._clock()
        if now < self._quiet_until:
            return
        step = (self.total or 0) * PLAIN_FRACTION
        due_by_count = bool(self.total) and self.done - self._last_done >= step
        if due_by_count or now - self._last_time >= PLAIN_INTERVAL_S:
            self._emit()

    def _finish(self) -> None:
        if self.done != self._last_done and (self._said or self._clock() >= self._quiet_until):
            self._emit()


class _RichBar(Bar):
    def __init__(self, label: str, total: int | None, stream: TextIO, nbytes: bool = False) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        super().__init__(label, total, nbytes)
        counts = (DownloadColumn(), TransferSpeedColumn()) if nbytes else (MofNCompleteColumn(),)
        self._progress: Any = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            *counts,
            TimeElapsedColumn(),
            console=Console(file=stream, emoji=False),
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(markup(label, 200), total=total)

    def _update(self) -> None:
        self._progress.update(self._task, completed=self.done, total=self.total)

    def _finish(self) -> None:
        self._progress.stop()


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:
        return False


@contextmanager
def progress(
    label: str,
    total: int | None,
    *,
    enabled: bool = True,
    nbytes: bool = False,
    quiet_for: float = 0.0,
    stream: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Bar]:
    """A progress display for `total` steps (None: unknown) of `label` work, bytes with
    `nbytes`; see the module. `quiet_for`: plain lines only once the work has taken that many
    seconds (work that usually ends sooner, such as the salvage after a run, stays silent)."""
    out = stream if stream is not None else sys.stderr
    bar: Bar
    if not enabled:
        bar = Bar(label, total, nbytes)
    elif _is_tty(out):
        bar = _RichBar(label, total, out, nbytes)
    else:
        bar = _PlainBar(label, total, out, clock, nbytes, quiet_for)
    try:
        yield bar
    finally:
        bar._finish()


__all__ = ["BIG_BYTES", "PLAIN_FRACTION", "PLAIN_INTERVAL_S", "Bar", "progress"]
