"""`kdump.dump_call(path, fn, *args, **kwargs)`: one call, one self-contained bundle."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdump import envinfo
from kdump.errors import UsageError
from kdump.log import log
from kdump.record.hooks import HookState, TargetSpec, busy
from kdump.record.sync.recorder import cuda_state, output_indices, own_tensor_work

if TYPE_CHECKING:
    from kdump.bundle.spool import Spool


def dump_call(
    path: str | os.PathLike[str], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """Call fn(*args, **kwargs) and write one self-contained bundle of it to `path`: inputs
    before, in-place outputs after (DeepGEMM: `d`; otherwise every tensor argument) and the
    return value. If fn raises, the bundle holds the pre-call inputs and the exception, and the
    exception is re-raised. A failure inside kdump is logged and fn's result returned anyway."""
    from kdump.bundle import attach_outputs, capture_call, input_tensors
    from kdump.bundle.writer import open_spool

    st = getattr(fn, "__kdump_state__", None)
    spec: TargetSpec | None = st.spec if isinstance(st, HookState) else None
    real = st.original if isinstance(st, HookState) else fn
    if spec is None:
        spec = _spec_of(real)
    target = spec.id if spec else _callable_text(real)
    names = _names_for(real, spec)
    call = None
    spool = open_spool(path)  # a large snapshot goes straight into the bundle file
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
        from kdump.format import argtree

        with own_tensor_work():
            tensors = argtree.tensors_in(args, kwargs)
            capturing, stream = cuda_state(tensors)
            if capturing:
                raise UsageError("dump_call cannot read tensors during CUDA-graph capture")
            meta.update(capturing=False, stream=stream)
            # the tensors compared after the call (device ones are also copied on the device)
            before = argtree.tensors_in(*args, *kwargs.values())
            watch = output_indices("default", spec, names, before, args, kwargs)
            call = capture_call(
                target,
                args,
                kwargs,
                called_as=target,
                names=pos,
                meta=meta,
                sink=spool,
                watch=watch,
            )
    except Exception as exc:
        log(f"dump_call: cannot capture {target} ({type(exc).__name__}: {exc}); calling it anyway")
    if call is None:
        spool.abort()
        return fn(*args, **kwargs)
    prev = busy.flag
    busy.flag = True
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        call.meta["exception"] = f"{type(exc).__name__}: {exc}"[:2000]
        _save_one(path, call, spool, cuda=call.meta.get("stream") is not None)
        raise
    finally:
        busy.flag = prev
    try:
        with own_tensor_work():
            live = input_tensors(call, args, kwargs)
            idx = output_indices("default", spec, names, live, args, kwargs)
            attach_outputs(call, live, idx, returned=result, sink=spool)
    except Exception as exc:
        log(f"dump_call: cannot snapshot the outputs of {target} ({type(exc).__name__}: {exc})")
        call.outputs = None
    _save_one(path, call, spool, cuda=call.meta.get("stream") is not None)
    return result


def _save_one(path: Any, call: Any, spool: Spool, *, cuda: bool) -> None:
    from kdump.bundle import save_calls

    try:
        env = envinfo.collect(cuda=cuda)  # GPU facts only when CUDA is in use: no CUDA init
        with own_tensor_work():
            save_calls(Path(path), [call], env=env, info={"recorder": "dump_call"}, spool=spool)
    except Exception as exc:
        spool.abort()
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
    from kdump.record.hooks import _signature_names, plugin_names

    if (names := _signature_names(fn)) is not None:
        return names
    if spec is not None and (names := plugin_names(spec.id, fn)) is not None:
        return names
    return spec.param_names if spec else None
