"""The sync recorder: snapshot the inputs before the call and the outputs after it, and write one
bundle per call at once.

Under CUDA-graph capture a sync snapshot is impossible (no sync, no D2H into pageable memory): the
sync recorder then writes the call's metadata only (argument tree, shapes, dtypes, strides,
addresses; no bytes) and marks it `capturing: true, data: metadata-only`.

A small CPU call repeated exactly (same argument values, tensor addresses and layouts, env) is
written by its repeat (kdump.record.sync.repeat): the same bundle for less work.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kdump import envinfo
from kdump.log import log_once
from kdump.record.capture_dir import CaptureDir
from kdump.record.config import Outputs, RecordConfig
from kdump.record.hooks import HookState, TargetSpec
from kdump.record.launch_hook import launch_of
from kdump.record.repeat import Repeats, Seen, repeat_key
from kdump.record.triggers import Limits, rank_allowed

if TYPE_CHECKING:
    from pathlib import Path

    from kdump.bundle.spool import StoreSpool
    from kdump.record.protocol import SessionCalls
    from kdump.record.sync.repeat import SyncRepeat

CAPTURE_NOTE = (
    "recorded during CUDA-graph capture: a sync recorder cannot read tensor data there; the "
    "flight recorder (mode ring) is needed for the values a replay of this graph sees"
)


class TensorPlaceholder:
    """Stands for a tensor whose bytes were not read (metadata-only capture)."""

    def __init__(self, index: int, t: Any) -> None:
        self.text = (
            f"tensor#{index} {str(t.dtype).replace('torch.', '')} {list(t.shape)} "
            f"stride {list(t.stride())} at {t.data_ptr():#x} on {t.device}"
        )

    def __repr__(self) -> str:
        return self.text


class _Process:
    """Per-process facts (re-made in forked children)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self._rank: int | None = None
        self._rank_final = False
        self._env: dict[str, Any] | None = None
        self._gpu: dict[str, Any] | None = None
        self._last: tuple[str, dict[str, Any]] | None = None  # (its changing parts, encoded)

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

    def env(self, cuda: bool, libraries: dict[str, Any] | None = None) -> dict[str, Any]:
        """The environment manifest: collected once per process, GPU facts once CUDA is in use
        (never initialising CUDA for a CPU call), library state fresh for every bundle.

        While the GPU facts and the library state encode as before, the previous bundle's dict
        is returned again (the header cache then reuses its encoding); it is never edited."""
        from kdump.bundle.manifest import encode_json as _encode

        if self._env is None:
            self._env = envinfo.collect(include_gpu=False)
        gpu = self._gpu
        if gpu is None:
            gpu = envinfo.gpu_info(cuda=cuda)
            if "cuda_available" in gpu:  # asked once: the facts do not change
                self._gpu = gpu
        if libraries is None:
            libraries = envinfo.library_state()
        parts = _encode([gpu, libraries])
        last = self._last
        if last is not None and last[0] == parts:
            return last[1]
        env = {**self._env, **gpu, "libraries": libraries}
        self._last = (parts, env)
        return env


class SyncRecorder:
    """Snapshot before the call, outputs after it, one bundle per call written at once."""

    mode = "sync"
    repeat = True  # exact repeats of a small CPU call take kdump.record.sync.repeat's path
    REPEATS_MAX = 64  # repeats kept (the least recently used goes first)
    SIGHTED_MAX = 1024

    def __init__(self, cfg: RecordConfig, session: SessionCalls) -> None:
        self.cfg = cfg
        self.session = session
        self._init_process()

    def _init_process(self) -> None:
        self.lock = threading.RLock()  # one writer at a time (threads may call targets)
        trig = self.cfg.trigger
        self.proc = _Process()
        self.dest = CaptureDir(
            self.cfg.out,
            Limits(trig.max_bundles, trig.max_bytes, trig.keep),
            private_store=self.cfg.private_store,
            host=self.proc.host,
            pid=self.proc.pid,
            rank=lambda: self.proc.rank()[0],
            mode=self.mode,
        )
        self._shorts: dict[str, str] = {}
        self.errors = 0
        # One object for the recorder's life: the header cache encodes it once.
        self._info = {"recorder": "sync", "session": self.session.started_ns}
        from kdump.bundle.header_cache import HeaderCache

        self.headers = HeaderCache()  # repeated call signatures: headers from a template
        # Exact repeats by repeat key (kdump.record.repeat; taken out while a call uses one),
        # made for a key seen before (a key seen once costs nothing).
        self._repeats: Repeats[SyncRepeat] = Repeats(self.REPEATS_MAX, self.SIGHTED_MAX)
        self.repeated = 0  # bundles written by a repeat
        # Targets whose last recorded call had CUDA tensors (never a repeat): no key is made for
        # their next call.
        self._on_device: set[str] = set()

    def after_fork(self) -> None:
        self._init_process()

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
        snap = None
        plan = None
        sink = None
        live: list[Any] = []
        seen: Seen | None = None
        rep: SyncRepeat | None = None
        try:
            with own_tensor_work():
                plan = self._plan(st, index, args, kwargs)
                launch = launch_of(fn)
                # a Triton launch's record is no part of a repeat: it takes the ordinary path
                if (
                    plan == "dump"
                    and self.repeat
                    and launch[0] is None
                    and st.id not in (self._on_device)
                ):
                    seen, rep, meta = self._repeat_for(st, index, called_as, args, kwargs)
                    if rep is not None:
                        rep.take_inputs()
                if plan == "dump" and rep is None:  # a large snapshot goes to the blob store
                    from kdump.bundle.spool import StoreSpool
                    from kdump.bundle.writer import STORE_MIN

                    sink = StoreSpool(self._blob_store, STORE_MIN)
                if plan is not None and rep is None:
                    snap, live = self._snapshot(
                        st, index, called_as, args, kwargs, plan, sink, launch
                    )
        except Exception as exc:
            rep = None
            self.session.fail(st, "capturing the arguments", exc)
        if rep is not None and seen is not None:
            return self._again(st, rep, seen[1], meta, index, fn, args, kwargs)
        if snap is None:
            return fn(*args, **kwargs)
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            try:  # the snapshot taken BEFORE the call; nothing is read after it raised
                snap.meta["exception"] = f"{type(exc).__name__}: {exc}"[:2000]
                with own_tensor_work():
                    self._write(st, snap, index, sink)
            except Exception as exc2:
                self.session.fail(st, "writing the bundle", exc2)
            raise
        if plan == "dump":
            try:
                with own_tensor_work():
                    if not snap.meta.get("capturing"):
                        self._attach_outputs(st, snap, live, args, kwargs, result, sink)
                    self._write(st, snap, index, sink, seen)
            except Exception as exc:
                self.session.fail(st, "writing the bundle", exc)
        return result

    # -- exact repeats ----------------------------------------------------------------------------
    def _repeat_for(
        self, st: HookState, index: int, called_as: str, args: tuple[Any, ...], kwargs: dict
    ) -> tuple[Seen | None, SyncRepeat | None, dict[str, Any]]:
        """(the call's repeat key and tensors, the repeat to take with its meta (taken out of the
        table), or None for the ordinary path)."""
        seen = repeat_key(st.id, called_as, args, kwargs)
        if seen is None:
            return None, None, {}
        rep = self._repeats.pop(seen[0], None)
        if rep is None:
            return seen, None, {}
        if not rep.matches(st.names(), seen[1]):
            return seen, None, {}  # another object (or storage size) with the same facts
        # The env is checked after the call, as the ordinary path takes it (`_usable`).
        return seen, rep, self._meta(index, "dump", None, False, envinfo.library_state())

    def _usable(self, rep: SyncRepeat, live: list[Any], meta: dict[str, Any]) -> bool:
        """After the call: whether the repeat writes what the ordinary path would. The tensors
        must have the facts the learned call left them with (a call may resize, move or reshape
        its outputs: `out=` semantics, a data-dependent size), the process must be the one that
        learned it (not a child forked inside the call) and the env the one it was written
        with."""
        return (
            os.getpid() == rep.pid
            and rep.left_as(live)
            and self.proc.env(False, meta["library_state"]) is rep.env
        )

    def _again(
        self,
        st: HookState,
        rep: SyncRepeat,
        live: list[Any],
        meta: dict[str, Any],
        index: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """The call, recorded by repeat `rep` whose inputs were just taken."""
        try:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                try:
                    call = self._from_repeat(rep, meta)
                    call.meta["exception"] = f"{type(exc).__name__}: {exc}"[:2000]
                    with own_tensor_work():
                        self._write(st, call, index)
                except Exception as exc2:
                    self.session.fail(st, "writing the bundle", exc2)
                raise
            try:
                with own_tensor_work():
                    if (
                        result is not None
                        or not self._usable(rep, live, meta)
                        or not self._write_again(st, rep, meta, index)
                    ):
                        call = self._from_repeat(rep, meta)
                        self._attach_outputs(st, call, live, args, kwargs, result)
                        self._write(st, call, index)
            except Exception as exc:
                self.session.fail(st, "writing the bundle", exc)
            return result
        finally:
            # Back as the most recently used, unless the call made a newer one (or it belongs
            # to the parent of a process forked inside the call).
            if os.getpid() == rep.pid:
                self._repeats.setdefault(rep.key, rep)

    def _from_repeat(self, rep: SyncRepeat, meta: dict[str, Any]) -> Any:
        """The call as the ordinary path records it, its inputs those the repeat took."""
        from kdump.bundle.capture import CallRecord

        c = rep.call
        return CallRecord(
            target=c.target,
            called_as=c.called_as,
            args=c.args,
            kwargs=c.kwargs,
            names=c.names,
            inputs=rep.inputs_captured(),
            meta=meta,
        )

    def _write_again(
        self, st: HookState, rep: SyncRepeat, meta: dict[str, Any], index: int
    ) -> bool:
        """Write the call's bundle by its repeat; False where the ordinary path must."""
        with self.lock:
            if not self.dest.admit():
                return True
            data = rep.bundle(meta)
            if data is None:
                return False
            path = self.dest.new_bundle_file(f"{self.short_name(st.id)}-{index:06d}")
            self.dest.store().begin()
            try:
                _sync_repeat().write(path, data)
            except BaseException:
                self.dest.abandon(path)
                raise
            self.dest.add(path, st.id, index, None, len(data))
            self.repeated += 1
        return True

    def _learn(
        self,
        st: HookState,
        call: Any,
        seen: Seen,
        env: dict[str, Any],
        header: list[tuple[bytes, Any]],
    ) -> None:
        """Make the repeat of a call just written the ordinary way, its key seen before."""
        from kdump.bundle.writer import STORE_MIN

        key = seen[0]
        if key in self._repeats or not header or not self._repeats.sighted_before(key):
            return
        got = self.headers.repeat_form()
        if got is None:
            return
        form, created = got
        raw, digests = header[-1]
        rep = _sync_repeat().make(
            seen, st.names(), env, call, raw, digests, form, created, STORE_MIN
        )  # after the call: `seen`'s tensors have the facts it left them with
        if rep is not None:
            self._repeats.keep(key, rep)  # the least recently used go beyond REPEATS_MAX

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
        if not self.dest.admit():
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
        sink: StoreSpool | None = None,
        launch: tuple[Any, list[str]] = (None, []),
    ) -> tuple[Any, list[Any]]:
        """(the call's record, its live tensors in tensor-table order). `launch`: a Triton
        launch's record and notes (kdump.record.launch_hook.launch_of)."""
        from kdump.bundle.capture import capture_call
        from kdump.format import argtree

        tensors: list[Any] = []
        trees = argtree.encode_all([*args, *kwargs.values()], tensors)  # one walk of the args
        capturing, stream = cuda_state(tensors)
        names = st.names()
        pos_names = list(names[: len(args)]) if names and len(names) >= len(args) else None
        meta = self._meta(index, plan, stream, capturing, envinfo.library_state())
        if launch[1]:
            meta["notes"] = list(launch[1])
        if not capturing:
            call = capture_call(
                st.id,
                args,
                kwargs,
                called_as=called_as,
                names=pos_names,
                meta=meta,
                sink=sink,
                encoded=(trees, tensors),
                # the tensors `_attach_outputs` compares after the call (a call snapshot only in
                # case it raises gets no outputs: nothing to compare)
                watch=output_indices(self.cfg.outputs, st.spec, names, tensors, args, kwargs)
                if plan == "dump"
                else (),
            )
            call.launch = launch[0]
            return call, tensors
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
        call = capture_call(
            st.id, ph_args, ph_kwargs, called_as=called_as, names=pos_names, meta=meta
        )
        call.launch = launch[0]
        return call, tensors

    def _meta(
        self,
        index: int,
        plan: str,
        stream: int | None,
        capturing: bool,
        libraries: dict[str, Any],
    ) -> dict[str, Any]:
        """The call's meta, read before the call (both paths: their bundles must agree)."""
        rank, _ = self.proc.rank()
        return {
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
            "library_state": libraries,
        }

    def _attach_outputs(
        self,
        st: HookState,
        call: Any,
        live: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: Any,
        sink: StoreSpool | None = None,
    ) -> None:
        from kdump.bundle.capture import attach_outputs

        idx = output_indices(self.cfg.outputs, st.spec, st.names(), live, args, kwargs)
        if idx or result is not None:
            attach_outputs(call, live, idx, returned=result, sink=sink)

    def _blob_store(self) -> Any:
        with self.lock:  # the process folder is made once, by one thread
            return self.dest.store().store

    def _write(
        self,
        st: HookState,
        call: Any,
        index: int,
        sink: StoreSpool | None = None,
        seen: Seen | None = None,
    ) -> None:
        """Write the call's bundle the ordinary way; with `seen` (its repeat key and tensors), a
        call that may repeat exactly also makes its repeat."""
        from kdump.bundle.writer import STORE_MIN, save_calls

        with self.lock:
            if not self.dest.admit():
                return
            path = self.dest.new_bundle_path(f"{self.short_name(st.id)}-{index:06d}")
            store = self.dest.store()
            store.begin()
            if sink is not None:  # blobs the snapshot added to the store count for this bundle
                store.created.update(sink.created)
            cuda = call.meta.get("stream") is not None  # set only when a CUDA tensor is involved
            size: list[int] = []  # the bundle file's size, where the writer knows it
            header: list[tuple[bytes, Any]] = []  # its header, where the header cache made it
            # The library state read at the call (it is the same a moment later).
            env = self.proc.env(cuda, call.meta.get("library_state"))
            learn = seen is not None and not cuda and "exception" not in call.meta
            if cuda:
                self._on_device.add(st.id)
            else:
                self._on_device.discard(st.id)
            try:
                save_calls(
                    path,
                    [call],
                    env=env,
                    store=store.store,
                    info=self._info,
                    inline_below=STORE_MIN,
                    spool=sink,
                    headers=self.headers,
                    sized=size.append,
                    headed=(lambda raw, digs: header.append((raw, digs))) if learn else None,
                )
            except BaseException:
                self.dest.abandon(path)
                raise
            self.dest.add(path, st.id, index, call.meta.get("exception"), size[0] if size else None)
            if learn and seen is not None and not store.used:
                self._learn(st, call, seen, env, header)

    # -- flush ------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Sync mode writes bundles at once: flushing = finish the write in progress (the lock)
        and append a status line to the index."""
        try:
            with self.lock:
                self.dest.note_status(self.errors)
        except Exception as exc:  # flush runs at exit and in signal handlers: never raise
            log_once(f"index:{self.proc.pid}", f"cannot append to the index: {exc}")

    def close(self) -> None:
        self.flush()
        with self.lock:
            self.dest.close()

    @property
    def written(self) -> list[Path]:
        return self.dest.written


_SYNC_REPEAT: Any = None


def _sync_repeat() -> Any:
    """kdump.record.sync.repeat, imported on first need (it imports torch)."""
    global _SYNC_REPEAT
    if _SYNC_REPEAT is None:
        from kdump.record.sync import repeat as sync_repeat

        _SYNC_REPEAT = sync_repeat
    return _SYNC_REPEAT


def own_tensor_work() -> contextlib.AbstractContextManager[Any]:
    """Around kdump's own tensor operations: `__torch_function__` subclasses of the recorded
    program never see them (their counters, logs and dispatch stay those of the program)."""
    torch = sys.modules.get("torch")  # no torch imported: no tensors, nothing to hide
    if torch is None:
        return contextlib.nullcontext()
    return torch._C.DisableTorchFunctionSubclass()


def cuda_state(tensors: Sequence[Any]) -> tuple[bool, int | None]:
    """(capturing, stream handle) — only asked when a CUDA tensor is involved (no CUDA init)."""
    if not any(getattr(t, "is_cuda", False) for t in tensors):
        return False, None
    import torch

    return bool(torch.cuda.is_current_stream_capturing()), int(
        torch.cuda.current_stream().cuda_stream
    )


def output_indices(
    outputs: Outputs,
    spec: TargetSpec | None,
    names: Sequence[str] | None,
    live: Sequence[Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> list[int]:
    """Indices into the call's tensor table of the tensors to snapshot after the call.

    "default" is the spec's output parameters, or every tensor argument for a target whose spec
    names none (a generic function: any argument may be written in place; content
    de-duplication stores the unchanged ones once)."""
    if outputs == "none":
        return []
    wanted = (spec.output_names if spec else ()) if outputs == "default" else outputs
    if outputs == "all" or (outputs == "default" and not wanted):
        return list(range(len(live)))
    objs: list[Any] = []
    for w in wanted:
        if isinstance(w, int):
            if 0 <= w < len(args):
                objs.append(args[w])
        elif w in kwargs:
            objs.append(kwargs[w])
        elif names is not None and w in names and names.index(w) < len(args):
            objs.append(args[names.index(w)])
    from kdump.format import argtree

    found = argtree.tensors_in(*objs)
    return [i for i, t in enumerate(live) if any(t is f for f in found)]
