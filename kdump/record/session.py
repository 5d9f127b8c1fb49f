"""Recording sessions: `kdump.recording(...)`, the registry of active sessions, fork and exit.

    with kdump.recording("deep_gemm", out="dumps/", calls="0-9") as rec:
        run_model()
    print(rec.written)

Where bundles go: kdump.record.capture_dir. How calls are kept: a `Recorder`
(kdump.record.protocol), the seam between the hooks and the recording mode. `SyncRecorder`
(kdump.record.sync.recorder) snapshots inputs before the call and in-place outputs after it and
writes a bundle at once; the flight recorder (`mode="ring"`, kdump.record.flight.recorder) keeps
the last calls in a crash-proof journal. A recorder gets the session's callbacks
(`SessionCalls`: triggers, failures, disarming) when it is made and never imports this module.

Failure isolation: everything kdump does around a call is inside try/except; a failure logs one
line ("kdump: ...") and switches recording of that target off. The original function runs with
the original arguments, and its result or exception passes through as the same object.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kdump import config
from kdump.errors import UsageError
from kdump.format.journal import RUN_PREFIX
from kdump.kernels import registry as kernel_registry
from kdump.log import log, log_once
from kdump.record.config import RecordConfig, RingConfig, parse_outputs
from kdump.record.hooks import HookState, PatchSet, parse_targets
from kdump.record.protocol import Recorder, SessionCalls
from kdump.record.triggers import Trigger, TriggerConfig


def check_mode(mode: str) -> None:
    """Raise UsageError for a recording mode this build cannot run."""
    from kdump.record.config import MODES

    if mode not in MODES:
        raise UsageError(f"unknown recording mode {mode!r}; use ring or sync")


def make_recorder(cfg: RecordConfig, session: SessionCalls) -> Recorder:
    check_mode(cfg.mode)
    if cfg.mode == "ring":
        from kdump.record.flight.recorder import RingRecorder

        return RingRecorder(cfg, session)
    from kdump.record.sync.recorder import SyncRecorder

    return SyncRecorder(cfg, session)


# ---------------------------------------------------------------------------------------------
# Sessions

_ACTIVE: list[Recording] = []
STATUS_PREFIX = "kdump-status-"  # kdump-status-PID-N.json in a `kdump record` run's folder
_STATUS_SEQ = itertools.count()
_active_lock = threading.Lock()


class Recording:
    """One recording session: targets patched, a recorder, per-target triggers."""

    def __init__(self, cfg: RecordConfig) -> None:
        self.cfg = cfg
        self.specs = parse_targets(list(cfg.targets))
        self.started_ns = time.time_ns()
        calls = SessionCalls(
            self.trigger, self.fail, self.disarm, self.disarm_all, started_ns=self.started_ns
        )
        self.recorder: Recorder = make_recorder(cfg, calls)
        self._triggers: dict[str, Trigger] = {}
        self._counters: dict[str, Any] = {}
        self.patches = PatchSet(self.specs, self.recorder.on_call, self._on_setter, self._setup)
        self.patches.on_change = self.write_status
        self.active = False
        self.failures: list[str] = []  # why targets were switched off, for the status file
        self._status_seq = next(_STATUS_SEQ)

    # -- hooks' callbacks ------------------------------------------------------------------------
    def trigger(self, target: str) -> Trigger:
        t = self._triggers.get(target)
        if t is None:
            t = self._triggers[target] = Trigger(self.cfg.trigger, warn=log_once)
        return t

    def _setup(self, st: HookState) -> None:
        if st.spec.kind == "setter":
            return
        st.counter = self._counters.setdefault(st.id, itertools.count())
        st.consider = self.trigger(st.id).consider

    def _on_setter(
        self, st: HookState, called_as: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        kernel_registry.note_setter(st.id, st.spec.qualname, args, kwargs)

    def fail(self, st: HookState, what: str, exc: BaseException) -> None:
        """Log once and switch the target off; never raises."""
        try:
            self.disarm(st.id)
            self.recorder.errors += 1
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                reason = f"disk full ({reason})"
            self.failures.append(f"{what} for {st.id} failed ({reason})"[:1000])
            self.write_status()
            log_once(
                f"fail:{st.id}",
                f"{what} for {st.id} failed ({reason}); recording of this target is off, the "
                "program continues unaffected",
            )
        except Exception:
            pass

    def disarm(self, target: str) -> None:
        for st in self.patches.states:
            if st.id == target and st.spec.kind != "setter":
                st.disarm()

    def disarm_all(self) -> None:
        for st in self.patches.states:
            if st.spec.kind != "setter":
                st.disarm()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> Recording:
        try:
            self.patches.patch()
        except BaseException:
            self.patches.unpatch()  # nothing stays half-patched
            raise
        self.active = True
        with _active_lock:
            _ACTIVE.append(self)
        self.write_status()
        return self

    # -- what `kdump record` learns from this process -----------------------------------------
    def status_path(self) -> Path | None:
        """Where this process tells `kdump record` how its targets fared: a file in the run's
        folder, only in a process `kdump record` started (never for `kdump.recording()` alone)."""
        if not config.get_flag("KDUMP_RECORD"):
            return None
        run = self.cfg.ring.journal_dir
        if not run.name.startswith(RUN_PREFIX):
            return None
        return run / f"{STATUS_PREFIX}{os.getpid()}-{self._status_seq}.json"

    def write_status(self) -> None:
        """Write the targets' states (hooks.PatchSet.report) and the failures, atomically; the
        launcher reads them after the program ended. Never raises."""
        with contextlib.suppress(Exception):
            path = self.status_path()
            if path is None:
                return
            doc = {"pid": os.getpid(), "targets": self.patches.report(), "failures": self.failures}
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        try:
            self.patches.unpatch()
        finally:
            with _active_lock:
                if self in _ACTIVE:
                    _ACTIVE.remove(self)
            self.recorder.close()

    def flush(self) -> None:
        self.recorder.flush()

    def after_fork(self) -> None:
        """Child of a fork: new pid folder, fresh counters, limits and trigger state."""
        self.recorder.after_fork()
        self._counters.clear()
        for t in self._triggers.values():
            t.reset()
        for st in self.patches.states:
            if st.spec.kind != "setter":
                st.counter = self._counters.setdefault(st.id, itertools.count())
                st.armed = True

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def written(self) -> list[Path]:
        """Bundles this session wrote in this process (and still on disk)."""
        return list(self.recorder.written)


def active_sessions() -> list[Recording]:
    with _active_lock:
        return list(_ACTIVE)


def flush_all() -> None:
    """Flush every active session; never raises (called from signal handlers and atexit)."""
    for s in active_sessions():
        try:
            s.flush()
        except Exception as exc:
            log_once(f"flush:{id(s)}", f"flush failed: {type(exc).__name__}: {exc}")
        s.write_status()  # a module imported where no watcher saw it


def _after_fork_in_child() -> None:
    global _active_lock
    _active_lock = threading.Lock()  # a lock held by another thread at fork time stays held
    for s in list(_ACTIVE):
        try:
            s.after_fork()
        except Exception as exc:
            log(f"re-initialising recording after fork failed: {exc}")


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(flush_all)


def recording(
    target: str | Iterable[str] = "deep_gemm",
    out: str | os.PathLike[str] = "kdump-out",
    *,
    calls: str | Iterable[int] | None = None,
    every: int | None = None,
    first_per_signature: int | None = None,
    ranks: str | Iterable[int] | None = None,
    predicate: str | Callable[..., Any] | None = None,
    max_bundles: int | None = None,
    max_bytes: int | str | None = None,
    keep: str = "oldest",
    on_exception: bool = False,
    outputs: str | Sequence[str | int] | None = "default",
    mode: str = "sync",
    ring: RingConfig | None = None,
) -> Recording:
    """Record calls of `target` (a preset, 'module:qualname', 'torch.ops.ns.op', or a list) while
    the returned context is active. See kdump.record.triggers for how the criteria combine;
    `on_exception` alone snapshots every call (costly) and is off by default."""
    cfg = RecordConfig(
        targets=(target,) if isinstance(target, str) else tuple(target),
        out=Path(out),
        mode=mode,
        trigger=TriggerConfig.build(
            calls=calls,
            every=every,
            first_per_signature=first_per_signature,
            ranks=ranks,
            predicate=predicate,
            max_bundles=max_bundles,
            max_bytes=max_bytes,
            keep=keep,
            on_exception=on_exception,
        ),
        outputs=parse_outputs(outputs),
        ring=ring or RingConfig(),
    )
    return Recording(cfg).start()
