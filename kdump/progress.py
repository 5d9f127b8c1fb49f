"""Progress of long CLI work (replaying a folder, packing bundles): one small API.

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


class Bar:
    """What the caller advances; the output is the subclass's business."""

    def __init__(self, label: str, total: int | None) -> None:
        self.label = label
        self.total = total  # may be set later, once known
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
        self, label: str, total: int | None, stream: TextIO, clock: Callable[[], float]
    ) -> None:
        super().__init__(label, total)
        self._stream = stream
        self._clock = clock
        self._last_time = clock()
        self._last_done = 0

    def _line(self) -> str:
        label = visible(self.label, 200)
        if self.total:
            return f"{label}: {self.done}/{self.total} ({100 * self.done // self.total}%)"
        return f"{label}: {self.done}"

    def _emit(self) -> None:
        try:
            self._stream.write(self._line() + "\n")
            self._stream.flush()
        except Exception:  # progress never breaks the work it reports
            pass
        self._last_time = self._clock()
        self._last_done = self.done

    def _update(self) -> None:
        step = (self.total or 0) * PLAIN_FRACTION
        due_by_count = bool(self.total) and self.done - self._last_done >= step
        if due_by_count or self._clock() - self._last_time >= PLAIN_INTERVAL_S:
            self._emit()

    def _finish(self) -> None:
        if self.done != self._last_done:
            self._emit()


class _RichBar(Bar):
    def __init__(self, label: str, total: int | None, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        super().__init__(label, total)
        self._progress: Any = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(file=stream),
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
    stream: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[Bar]:
    """A progress display for `total` steps (None: unknown) of `label` work; see the module."""
    out = stream if stream is not None else sys.stderr
    bar: Bar
    if not enabled:
        bar = Bar(label, total)
    elif _is_tty(out):
        bar = _RichBar(label, total, out)
    else:
        bar = _PlainBar(label, total, out, clock)
    try:
        yield bar
    finally:
        bar._finish()


__all__ = ["PLAIN_FRACTION", "PLAIN_INTERVAL_S", "Bar", "progress"]
