"""The seam between a recording session (kdump.record.session) and its recorder.

A `Recorder` is what the session drives: the hooks hand it each considered call (`on_call`, the
hot path), the session flushes it (at exit, SIGTERM/SIGINT and the flush signal), closes it,
re-makes its per-process state in a forked child and reads what it wrote and how often it
failed. `SyncRecorder` (kdump.record.sync.recorder) and the flight recorder `RingRecorder`
(kdump.record.flight.recorder) implement it.

`SessionCalls` is what a recorder may ask of its session, handed to it when it is made: a
recorder never imports the session (the session imports the recorders).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from kdump.record.hooks import HookState
    from kdump.record.triggers import Trigger


@dataclass(frozen=True)
class SessionCalls:
    """The session's callbacks for its recorder."""

    trigger: Callable[[str], Trigger]  # the trigger state of a target in this process
    # log once and switch a target off (what failed, for which call); never raises
    fail: Callable[[HookState, str, BaseException], None]
    disarm: Callable[[str], None]  # switch a target's hooks off (its trigger is exhausted)
    disarm_all: Callable[[], None]  # this process records nothing more (rank, limits)
    started_ns: int  # when the session started (the sync recorder's bundles name it)


class Recorder(Protocol):
    """What a recording session drives (see the module docstring)."""

    mode: str  # "sync" or "ring"
    errors: int  # failures so far (the session counts each `SessionCalls.fail`)

    def on_call(
        self,
        st: HookState,
        index: int,
        called_as: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Record (or not) one considered call of `st`'s target and make it: `fn(*args,
        **kwargs)`'s result or exception, unchanged. The hooks mark the thread busy meanwhile
        (hooked calls made inside pass through unrecorded)."""
        ...

    def flush(self) -> None:
        """Write what is kept so far (the process goes on); never raises."""
        ...

    def close(self) -> None:
        """End of the session in this process."""
        ...

    def after_fork(self) -> None:
        """In a forked child: new per-process state (the parent's files stay the parent's)."""
        ...

    @property
    def written(self) -> list[Path]:
        """Bundles this recorder wrote in this process."""
        ...
