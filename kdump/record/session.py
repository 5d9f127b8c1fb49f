"""Recording sessions: `kdump.recording(...)`, `kdump.dump_call(...)`, and the sync recorder.

    with kdump.recording("deep_gemm", out="dumps/", calls="0-9") as rec:
        run_model()
    print(rec.written)

Layout of a capture directory (one subfolder per process, blobs shared):
    <out>/blobs/ab/<sha256>                            shared blob store (weights stored once)
    <out>/<host>-<pid>[-rank<R>]/<target>-<index:06d>.kdump
    <out>/<host>-<pid>[-rank<R>]/index.json            what this process wrote (rewritten at flush)
With a limit that deletes bundles (max_bytes, or keep=newest) each process keeps its blobs in its
own folder (`<proc>/blobs/`), so evicting never removes a blob another process's bundle uses.

Recorders. `Recorder` is the seam between the hooks and how calls are kept: `SyncRecorder`
snapshots inputs before the call and in-place outputs after it and writes a bundle at once. The
flight recorder (`mode="ring"`) will implement the same three methods: `on_call` (hot
path entry for a considered call), `flush` (called at exit, SIGTERM/SIGINT and the flush signal)
and `close`. Under CUDA-graph capture a sync snapshot is impossible (no sync, no D2H into pageable
memory): the sync recorder then writes the call's metadata only (argument tree, shapes, dtypes,
strides, addresses; no bytes) and marks it `capturing: true, data: metadata-only`; the ring
recorder is what will capture data there.

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
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kdump import config, envinfo
from kdump.errors import UsageError
from kdump.kernels.deepgemm import state as deepgemm_state
from kdump.record.hooks import HookState, PatchSet, TargetSpec, busy, log, log_once, parse_targets
from kdump.record.triggers import Limits, Trigger, TriggerConfig, Written, rank_allowed

MODES = ("sync", "ring")
CAPTURE_NOTE = (
    "recorded during CUDA-graph capture: a sync recorder cannot read tensor data there; the "
    "flight recorder (mode ring) is needed for the values a replay of this graph sees"
)


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class RecordConfig:
    targets: tuple[str, ...] = ("deep_gemm",)
    out: Path = Path("kdump-out")
    mode: str = "sync"
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    outputs: str | tuple[str | int, ...] = "default"  # default | none | all | names/positions

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"unknown recording mode {self.mode!r}; use sync")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RecordConfig:
        """The configuration `kdump record` passes to its processes (kdump.config.ENV_VARS)."""

        def get(name: str) -> str | None:
            return config.get(name, env)

        targets = tuple(t.strip() for t in (get("KDUMP_TARGETS") or "deep_gemm").split(","))
        return cls(
            targets=tuple(t for t in targets if t),
            out=Path(get("KDUMP_OUT") or "kdump-out"),
            mode=(get("KDUMP_MODE") or "sync").lower(),
            trigger=TriggerConfig.build(
                calls=get("KDUMP_CALLS"),
                every=get("KDUMP_EVERY"),
                first_per_signature=get("KDUMP_FIRST_PER_SIGNATURE"),
                ranks=get("KDUMP_RANKS"),
                predicate=get("KDUMP_PREDICATE"),
                max_bundles=get("KDUMP_MAX_BUNDLES"),
                max_bytes=get("KDUMP_MAX_BYTES"),
                keep=get("KDUMP_KEEP") or "oldest",
                on_exception=config.get_flag("KDUMP_ON_EXCEPTION", env),
            ),
            outputs=parse_outputs(get("KDUMP_OUTPUTS")),
        )


def parse_outputs(value: Any) -> str | tuple[str | int, ...]:
    if value is None:
        return "default"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("", "default", "1", "true", "yes", "on"):
            return "default"
        if v in ("none", "0", "false", "no", "off"):
            return "none"
        if v == "all":
            return "all"
        items = [x.strip() for x in value.split(",") if x.strip()]
    else:
        items = list(value)
    return tuple(int(x) if isinstance(x, int) or str(x).isdigit() else str(x) for x in items)


# ---------------------------------------------------------------------------------------------
# Per-process facts (re-initialised in forked children)


class _Process:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self._rank: int | None = None
        self._rank_final = False
        self._env: dict[str, Any] | None = None

    def rank(self) -> tuple[int | None, bool]:
        """(rank, definitive). torch.distributed wins over RANK-style variables."""
        if self._rank_final:
            return self._rank, True
        dist = sys.modules.get("torch.distributed")
        try:
            if dist is not None and dist.is_available() and dist.is_initialized():
                self._rank, self._rank_final = int(dist.get_rank()), True
                return self._rank, True
        except Exception:
            pass
        r = envinfo.current_rank()
        if r is not None:
            self._rank, self._rank_final = r, True
        return r, r is not None

    def env(self) -> dict[str, Any]:
        """envinfo.collect() once per process; library state fresh for every bundle."""
        if self._env is None:
            self._env = envinfo.collect(include_gpu=True)
        return {**self._env, "libraries": envinfo.library_state()}


# ---------------------------------------------------------------------------------------------
# Recorders


class Recorder(Protocol):
    mode: str

    def on_call(
        self,
        st: HookState,
        index: int,
        called_as: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def make_recorder(cfg: RecordConfig, session: Recording) -> Recorder:
    if cfg.mode == "ring":
        raise UsageError(
            "recording mode 'ring' (the flight recorder) is not available yet; "
            "use mode='sync' (--mode sync)"
        )
    return SyncRecorder(cfg, session)


class TensorPlaceholder:
    """Stands for a tensor whose bytes were not read (metadata-only capture)."""

    def __init__(self, index: int, t: Any) -> None:
        self.text = (
            f"tensor#{index} {str(t.dtype).replace('torch.', '')} {list(t.shape)} "
            f"stride {list(t.stride())} at {t.data_ptr():#x} on {t.device}"
        )

    def __repr__(self) -> str:
        return self.text


class _CountingStore:
    """A BlobStore that remembers which blobs each bundle used and which it created."""

    def __init__(self, root: Path) -> None:
        from kdump.bundle import BlobStore

        class Store(BlobStore):
            def put(inner, sha: str, data: memoryview) -> None:
                self.used.append(sha)
                if not inner.has(sha, len(data)):
                    BlobStore.put(inner, sha, data)
                    self.created[sha] = len(data)

        self.store = Store(root)
        self.used: list[str] = []
        self.created: dict[str, int] = {}

    def begin(self) -> None:
        self.used, self.created = [], {}


class SyncRecorder:
    """Snapshot before the call, outputs after it, one bundle per call written at once."""

    mode = "sync"

    def __init__(self, cfg: RecordConfig, session: Recording) -> None:
        self.cfg = cfg
        self.session = session
        self.lock = threading.RLock()  # one writer at a time (threads may call targets)
        self._init_process()

    # -- per process ------------------------------------------------------------------------------
    def _init_process(self) -> None:
        trig = self.cfg.trigger
        self.proc = _Process()
        self.limits = Limits(trig.max_bundles, trig.max_bytes, trig.keep)
        self.private_store = trig.max_bytes is not None or (
            trig.keep == "newest" and trig.max_bundles is not None
        )
        self._store: _CountingStore | None = None
        self._proc_dir: Path | None = None
        self._shorts: dict[str, str] = {}
        self._bundle_blobs: dict[str, list[str]] = {}  # bundle path -> blobs it uses
        self._blob_refs: dict[str, int] = {}
        self._blob_owned: dict[str, int] = {}  # blobs this process created (private store)
        self.errors = 0

    def after_fork(self) -> None:
        self.lock = threading.RLock()
        self._init_process()

    def proc_dir(self) -> Path:
        if self._proc_dir is None:
            rank, _ = self.proc.rank()
            name = f"{self.proc.host}-{self.proc.pid}" + (
                f"-rank{rank}" if rank is not None else ""
            )
            self._proc_dir = self.cfg.out / name
        return self._proc_dir

    def store(self) -> _CountingStore:
        if self._store is None:
            root = self.proc_dir() if self.private_store else self.cfg.out
            self._store = _CountingStore(root)
        return self._store

    def short_name(self, target: str) -> str:
        short = self._shorts.get(target)
        if short is None:
            short = target.split(":", 1)[-1]
            if short in self._shorts.values():  # two targets share a name: use the full id
                short = target.replace(":", ".")
            short = "".join(c if c.isalnum() or c in "._-" else "_" for c in short)
            self._shorts[target] = short
        return short

    # -- the call ---------------------------------------------------------------------------------
    def on_call(
        self,
        st: HookState,
        index: int,
        called_as: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        prev = busy.flag
        busy.flag = True  # hooked calls made inside this one pass through unrecorded
        try:
            snap = None
            plan = None
            try:
                plan = self._plan(st, index, args, kwargs)
                if plan is not None:
                    snap = self._snapshot(st, index, called_as, args, kwargs, plan)
            except Exception as exc:
                self.session.fail(st, "capturing the arguments", exc)
            if snap is None:
                return fn(*args, **kwargs)
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                try:  # the snapshot taken BEFORE the call; nothing is read after it raised
                    snap.meta["exception"] = f"{type(exc).__name__}: {exc}"[:2000]
                    self._write(st, snap, index)
                except Exception as exc2:
                    self.session.fail(st, "writing the bundle", exc2)
                raise
            if plan == "dump":
                try:
                    if not snap.meta.get("capturing"):
                        self._attach_outputs(st, snap, args, kwargs, result)
                    self._write(st, snap, index)
                except Exception as exc:
                    self.session.fail(st, "writing the bundle", exc)
            return result
        finally:
            busy.flag = prev

    def _plan(
        self, st: HookState, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str | None:
        trig = self.cfg.trigger
        if trig.ranks is not None:
            rank, final = self.proc.rank()
            if not rank_allowed(trig.ranks, rank):
                if final:  # this process never records: make its hooks free
                    self.session.disarm_all()
                return None
        if not self.limits.admit():
            self.session.disarm_all()
            return None
        trigger = self.session.trigger(st.id)
        if trigger.select(index, args, kwargs):
            return "dump"
        if trig.on_exception:
            return "exception"
        if trigger.is_exhausted(index):
            self.session.disarm(st.id)
        return None

    def _snapshot(
        self,
        st: HookState,
        index: int,
        called_as: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        plan: str,
    ) -> Any:
        from kdump.bundle import argtree, capture_call

        tensors = argtree.tensors_in(*args, *kwargs.values())
        capturing, stream = _cuda_state(tensors)
        names = st.names()
        pos_names = list(names[: len(args)]) if names and len(names) >= len(args) else None
        rank, _ = self.proc.rank()
        meta: dict[str, Any] = {
            "call_index": index,
            "pid": self.proc.pid,
            "host": self.proc.host,
            "rank": rank,
            "time_ns": time.time_ns(),
            "thread": threading.get_ident(),
            "stream": stream,
            "capturing": capturing,
            "mode": "sync",
            "trigger": "selected" if plan == "dump" else "exception",
            "library_state": envinfo.library_state(),
        }
        if not capturing:
            return capture_call(
                st.id, args, kwargs, called_as=called_as, names=pos_names, meta=meta
            )
        # Graph capture: no data can be read. Keep the layout of every tensor in the meta.
        from kdump.bundle.tensors import group_storages

        storages, records = group_storages(tensors)
        meta.update(
            data="metadata-only",
            note=CAPTURE_NOTE,
            tensors_metadata={
                "storages": [asdict(s) for s in storages],
                "tensors": [asdict(r) for r in records],
            },
        )

        def placeholder(t: Any) -> TensorPlaceholder:
            return TensorPlaceholder(next(k for k, x in enumerate(tensors) if x is t), t)

        ph_args = argtree.map_tensors(tuple(args), placeholder)
        ph_kwargs = argtree.map_tensors(dict(kwargs), placeholder)
        return capture_call(
            st.id, ph_args, ph_kwargs, called_as=called_as, names=pos_names, meta=meta
        )

    def _attach_outputs(
        self, st: HookState, call: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> None:
        from kdump.bundle import attach_outputs, input_tensors

        live = input_tensors(call, args, kwargs)
        idx = output_indices(self.cfg.outputs, st.spec, st.names(), live, args, kwargs)
        if idx or result is not None:
            attach_outputs(call, live, idx, returned=result)

    def _write(self, st: HookState, call: Any, index: int) -> None:
        from kdump.bundle import save_calls

        with self.lock:
            if not self.limits.admit():
                return
            d = self.proc_dir()
            path = d / f"{self.short_name(st.id)}-{index:06d}.kdump"
            store = self.store()
            store.begin()
            info = {"recorder": "sync", "session": self.session.started_ns}
            save_calls(path, [call], env=self.proc.env(), store=store.store, info=info)
            added = path.stat().st_size + sum(store.created.values())
            self._bundle_blobs[str(path)] = list(dict.fromkeys(store.used))
            for sha in self._bundle_blobs[str(path)]:
                self._blob_refs[sha] = self._blob_refs.get(sha, 0) + 1
            if self.private_store:
                self._blob_owned.update(store.created)
            exc = call.meta.get("exception")
            self.limits.add(Written(str(path), st.id, index, added, exc))
            while (victim := self.limits.victim()) is not None:
                self.limits.freed(self._delete(victim))
            self._write_index()

    def _delete(self, w: Written) -> int:
        """Remove a bundle and the blobs only it used (private store); bytes freed."""
        freed = 0
        p = Path(w.path)
        with contextlib.suppress(FileNotFoundError):
            freed += p.stat().st_size
            p.unlink()
        for sha in self._bundle_blobs.pop(w.path, []):
            n = self._blob_refs.get(sha, 0) - 1
            self._blob_refs[sha] = n
            if n <= 0:
                self._blob_refs.pop(sha, None)
                size = self._blob_owned.pop(sha, None)
                if size is not None:
                    with contextlib.suppress(FileNotFoundError):
                        self.store().store.path(sha).unlink()
                        freed += size
        return freed

    # -- flush ------------------------------------------------------------------------------------
    def _write_index(self) -> None:
        if self._proc_dir is None or not self._proc_dir.is_dir():
            return  # this process wrote nothing: no folder, no index
        rank, _ = self.proc.rank()
        index = {
            "format": "kdump-index",
            "version": 1,
            "mode": self.mode,
            "host": self.proc.host,
            "pid": self.proc.pid,
            "rank": rank,
            "argv": list(sys.argv)[:32],
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "store": str(self.store().store.root),
            "total_bytes": self.limits.total_bytes,
            "stopped_by_limit": self.limits.stopped,
            "errors": self.errors,
            "bundles": [
                {
                    "path": Path(w.path).name,
                    "target": w.target,
                    "call_index": w.index,
                    "bytes": w.nbytes,
                    "exception": w.exception,
                }
                for w in self.limits.bundles
            ],
        }
        path = self._proc_dir / "index.json"
        tmp = path.with_name(f".index.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, path)

    def flush(self) -> None:
        """Sync mode writes bundles at once: flushing = finish the write in progress (the lock)
        and rewrite index.json."""
        try:
            with self.lock:
                self._write_index()
        except Exception as exc:  # flush runs at exit and in signal handlers: never raise
            log_once(f"index:{self.proc.pid}", f"cannot write index.json: {exc}")

    def close(self) -> None:
        self.flush()

    @property
    def written(self) -> list[Path]:
        return [Path(w.path) for w in self.limits.bundles]


def _cuda_state(tensors: Sequence[Any]) -> tuple[bool, int | None]:
    """(capturing, stream handle) — only asked when a CUDA tensor is involved (no CUDA init)."""
    if not any(getattr(t, "is_cuda", False) for t in tensors):
        return False, None
    import torch

    return bool(torch.cuda.is_current_stream_capturing()), int(
        torch.cuda.current_stream().cuda_stream
    )


def output_indices(
    outputs: str | tuple[str | int, ...],
    spec: TargetSpec | None,
    names: Sequence[str] | None,
    live: Sequence[Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> list[int]:
    """Indices into the call's tensor table of the tensors to snapshot after the call."""
    if outputs == "none":
        return []
    if outputs == "all":
        return list(range(len(live)))
    wanted = (spec.output_names if spec else ()) if outputs == "default" else outputs
    objs: list[Any] = []
    for w in wanted:
        if isinstance(w, int):
            if 0 <= w < len(args):
                objs.append(args[w])
        elif w in kwargs:
            objs.append(kwargs[w])
        elif names is not None and w in names and names.index(w) < len(args):
            objs.append(args[names.index(w)])
    from kdump.bundle import argtree

    found = argtree.tensors_in(*objs)
    return [i for i, t in enumerate(live) if any(t is f for f in found)]


# ---------------------------------------------------------------------------------------------
# Sessions

_ACTIVE: list[Recording] = []
_active_lock = threading.Lock()


class Recording:
    """One recording session: targets patched, a recorder, per-target triggers."""

    def __init__(self, cfg: RecordConfig) -> None:
        self.cfg = cfg
        self.specs = parse_targets(list(cfg.targets))
        self.started_ns = time.time_ns()
        self.recorder: Recorder = make_recorder(cfg, self)
        self._triggers: dict[str, Trigger] = {}
        self._counters: dict[str, Any] = {}
        self.patches = PatchSet(self.specs, self.recorder.on_call, self._on_setter, self._setup)
        self.active = False

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
        if st.id.startswith("deep_gemm:"):
            deepgemm_state.note_setter(st.spec.qualname, args, kwargs)

    def fail(self, st: HookState, what: str, exc: BaseException) -> None:
        """Log once and switch the target off; never raises."""
        try:
            self.disarm(st.id)
            rec = self.recorder
            if isinstance(rec, SyncRecorder):
                rec.errors += 1
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                reason = f"disk full ({reason})"
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
        return self

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
        rec = self.recorder
        if isinstance(rec, SyncRecorder):
            rec.after_fork()
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
        rec = self.recorder
        return rec.written if isinstance(rec, SyncRecorder) else []

    @property
    def hooked(self) -> list[str]:
        """'called_as' names currently patched."""
        out = []
        for st in self.patches.states:
            for ref in st.refs:
                out.append(ref.name)
        return out


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
) -> Recording:
    """Record calls of `target` (a preset, 'module:qualname', 'torch.ops.ns.op', or a list) while
    the returned context is active. See kdump.record.triggers for how the criteria combine;
    `on_exception` alone snapshots every call (costly) and is off by default."""
    targets = (target,) if isinstance(target, str) else tuple(target)
    cfg = RecordConfig(
        targets=targets,
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
    )
    return Recording(cfg).start()


# ---------------------------------------------------------------------------------------------
# One call


def dump_call(
    path: str | os.PathLike[str], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """Call fn(*args, **kwargs) and write one self-contained bundle of it to `path`: inputs
    before, in-place outputs after (DeepGEMM: `d`; otherwise every tensor argument) and the
    return value. If fn raises, the bundle holds the pre-call inputs and the exception, and the
    exception is re-raised. A failure inside kdump is logged and fn's result returned anyway."""
    from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls

    st = getattr(fn, "__kdump_state__", None)
    spec: TargetSpec | None = st.spec if isinstance(st, HookState) else None
    real = st.original if isinstance(st, HookState) else fn
    if spec is None:
        spec = _spec_of(real)
    target = spec.id if spec else _callable_text(real)
    names = _names_for(real, spec)
    outputs: str | tuple[str | int, ...] = "default" if spec and spec.output_names else "all"
    call = None
    try:
        pos = list(names[: len(args)]) if names and len(names) >= len(args) else None
        meta = {
            "call_index": 0,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rank": envinfo.current_rank(),
            "time_ns": time.time_ns(),
            "thread": threading.get_ident(),
            "mode": "sync",
            "trigger": "dump_call",
            "library_state": envinfo.library_state(),
        }
        from kdump.bundle import argtree

        tensors = argtree.tensors_in(args, kwargs)
        capturing, stream = _cuda_state(tensors)
        if capturing:
            raise UsageError("dump_call cannot read tensors during CUDA-graph capture")
        meta.update(capturing=False, stream=stream)
        call = capture_call(target, args, kwargs, called_as=target, names=pos, meta=meta)
    except Exception as exc:
        log(f"dump_call: cannot capture {target} ({type(exc).__name__}: {exc}); calling it anyway")
    if call is None:
        return fn(*args, **kwargs)
    prev = busy.flag
    busy.flag = True
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        call.meta["exception"] = f"{type(exc).__name__}: {exc}"[:2000]
        _save_one(path, call, save_calls)
        raise
    finally:
        busy.flag = prev
    try:
        live = input_tensors(call, args, kwargs)
        idx = output_indices(outputs, spec, names, live, args, kwargs)
        attach_outputs(call, live, idx, returned=result)
    except Exception as exc:
        log(f"dump_call: cannot snapshot the outputs of {target} ({type(exc).__name__}: {exc})")
        call.outputs = None
    _save_one(path, call, save_calls)
    return result


def _save_one(path: Any, call: Any, save_calls: Callable[..., Any]) -> None:
    try:
        save_calls(Path(path), [call], env=envinfo.collect(), info={"recorder": "dump_call"})
    except Exception as exc:
        log(f"dump_call: cannot write {path} ({type(exc).__name__}: {exc})")


def _callable_text(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}:{qual}"


def _spec_of(fn: Any) -> TargetSpec | None:
    """The target spec a plain callable would have (canonical id, DeepGEMM outputs)."""
    from kdump.record.hooks import parse_target

    try:
        return parse_target(_callable_text(fn))[0]
    except Exception:  # <lambda>, locals: not a valid target name; a generic id is used
        return None


def _names_for(fn: Any, spec: TargetSpec | None) -> tuple[str, ...] | None:
    from kdump.record.hooks import _signature_names

    return _signature_names(fn) or (spec.param_names if spec else None)
