"""Patch and unpatch targets, with every reference to them, in loaded and later-imported modules.

Targets:
  'module:qualname'        any Python callable: function, method ('mod:Class.method', also static
                           and class methods), builtin / pybind function, callable object; a
                           Triton kernel (plain, autotuned, heuristics) is hooked at its launch
                           (kdump.record.launch_hook), not replaced
  'module:*'               every Triton kernel the module defines (resolved when it is imported)
  'torch.ops.ns.op'        a torch operator (also 'torch.ops.ns:op')
  a preset                 a kernel plug-in's target list (kdump.kernels.registry.presets), e.g.
                           'deep_gemm': every DeepGEMM entry point and alias in each module that
                           binds it, plus its global setters

How a target is patched. A call is identified by the ORIGINAL OBJECT, never by its name:
  1. The object is looked up where the target names it and replaced there by a wrapper.
  2. Every loaded module's globals are scanned (sys.modules) and each entry that IS the original
     object is replaced too: aliases (`m_grouped_fp8_gemm_nt_contiguous` is
     `m_grouped_fp8_fp4_gemm_nt_contiguous`), `from deep_gemm import X` copies, functions that
     vLLM caches in `vllm.utils.deep_gemm` globals on first use, pybind functions of `deep_gemm._C`.
  3. A target whose module is not imported yet is never imported by kdump: a meta-path finder
     watches for that module and patches (steps 1-2) right after it finished executing. Modules
     imported later that copy the function get the wrapper, since the source attribute is patched.
Each reference gets its own wrapper object, so the bundle knows the name a call was made by
(`called_as`), while all of them share one state (counter, trigger): an alias pair is recorded
once per call. A thread-local guard records only the outermost of nested hooked calls (a Python
wrapper calling a hooked `_C` function is one call). Patching twice wraps once; `unpatch` puts the
original back into every reference that still holds our wrapper.

Not covered: references held outside module globals (class attributes other than the target's
own, instance attributes, closures, functools.partial, containers) that were taken before
patching; calls made from C++.

torch.ops operators. The OpOverloadPacket attribute of the `torch.ops.<ns>` namespace is replaced
by a callable proxy (module globals holding the packet are rebound as in step 2). Seen:
`torch.ops.ns.op(...)` and `torch.ops.ns.op.<overload>(...)` (e.g. `.default`) looked up through
the namespace after patching, and packets cached in module globals. NOT seen: OpOverload objects
taken before patching, calls from C++ or from other operators' kernels, torch.compile / dynamo
graphs (they trace through the dispatcher), and autograd-internal calls. The dispatcher itself is
left alone (no impl override, no dispatch mode), so no other operator pays anything.
"""

from __future__ import annotations

import functools
import importlib.abc
import itertools
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kdump.errors import UsageError
from kdump.format.argtree import Pointer
from kdump.kernels.plugin import TargetSpec
from kdump.kernels.triton import launch as triton_launch
from kdump.log import log_once
from kdump.record import launch_hook

# ---------------------------------------------------------------------------------------------
# Targets


def _presets() -> dict[str, tuple[TargetSpec, ...]]:
    from kdump.kernels import registry

    return registry.presets()


def parse_target(text: str) -> list[TargetSpec]:
    """Expand one target string (a preset or 'module:qualname' / 'torch.ops.ns.op')."""
    text = text.strip()
    presets = _presets()
    if text in presets:
        return list(presets[text])
    if text.startswith("torch.ops.") and ":" not in text:
        module, _, name = text.rpartition(".")
    else:
        module, sep, name = text.partition(":")
        if not sep:
            raise UsageError(
                f"target {text!r}: give 'module:qualname' (e.g. mypkg.ops:gemm), "
                f"'torch.ops.<ns>.<op>', or a preset ({', '.join(presets)})"
            )
    if name == "*" and module and all(p.isidentifier() for p in module.split(".")):
        return [TargetSpec(module, "*", f"{module}:*")]
    if not module or not name or any(not p.isidentifier() for p in name.split(".")):
        raise UsageError(f"target {text!r}: {name!r} is not a valid qualified name")
    if module.startswith("torch.ops") and (module.count(".") != 2 or "." in name):
        raise UsageError(f"target {text!r}: torch operators are named torch.ops.<namespace>.<op>")
    from kdump.kernels import registry

    return [registry.target_spec(module, name)]


def parse_targets(texts: str | Iterable[str]) -> list[TargetSpec]:
    if isinstance(texts, str):
        texts = [t for t in texts.split(",") if t.strip()]
    out: list[TargetSpec] = []
    seen: set[tuple[str, str]] = set()
    for t in texts:
        for spec in parse_target(t):
            if (spec.module, spec.qualname) not in seen:
                seen.add((spec.module, spec.qualname))
                out.append(spec)
    if not out:
        raise UsageError("no targets given")
    return out


# ---------------------------------------------------------------------------------------------
# Hook state and wrappers

# Handler(state, index, called_as, fn, args, kwargs) -> fn's result. Only called on the slow path,
# with `busy.flag` set on the thread meanwhile.
_Args = tuple[Any, ...]
Handler = Callable[["HookState", int, str, Callable[..., Any], _Args, dict[str, Any]], Any]
# SetterHandler(state, called_as, args, kwargs): after a setter returned normally.
SetterHandler = Callable[["HookState", str, tuple[Any, ...], dict[str, Any]], None]


class _Busy(threading.local):
    flag = False  # inside a hooked call on this thread (nested hooked calls pass through)


busy = _Busy()


def _never(i: int) -> bool:
    return False


@dataclass(eq=False)
class HookState:
    """Everything one patched original object shares across its wrappers."""

    spec: TargetSpec
    original: Any
    handler: Handler | SetterHandler
    owner: Any = None  # the PatchSet that patched it
    armed: bool = True
    counter: Any = field(default_factory=itertools.count)  # next(counter) -> call index
    consider: Callable[[int], bool] = _never
    refs: list[_Ref] = field(default_factory=list)
    wrappers: list[Any] = field(default_factory=list)  # every wrapper object made for it
    param_names: tuple[str, ...] | None = None
    _names_known: bool = False
    launch: bool = False  # a Triton kernel hooked at its launch (kdump.record.launch_hook)

    @property
    def id(self) -> str:
        return self.spec.id

    def names(self) -> tuple[str, ...] | None:
        """Positional parameter names from the real signature, else the spec's table."""
        if not self._names_known:
            self._names_known = True
            self.param_names = (
                _signature_names(self.original)
                or plugin_names(self.spec.id, self.original)
                or self.spec.param_names
            )
        return self.param_names

    def disarm(self) -> None:
        self.armed = False


def _signature_names(fn: Any) -> tuple[str, ...] | None:
    import inspect

    try:
        sig = inspect.signature(fn)  # pybind functions and odd callables raise here
    except Exception:
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in sig.parameters.values() if p.kind in kinds)


def plugin_names(target_id: str, fn: Any) -> tuple[str, ...] | None:
    """Positional names the target's plug-in reads from the running build (pybind docstrings,
    torch.ops schemas) where `inspect.signature` cannot; None when it has none or fails."""
    try:
        from kdump.kernels import registry

        p = registry.plugin_for(target_id)
        return p.param_names(target_id, fn) if p is not None else None
    except Exception:
        return None


@dataclass(eq=False)
class _Ref:
    container: Any  # module, class, or torch.ops namespace
    name: str
    wrapper: Any  # what we stored (staticmethod/classmethod object for class members)
    previous: Any  # what was there


def _copy_metadata(wrapper: Any, original: Any) -> None:
    try:
        functools.update_wrapper(wrapper, original)
    except Exception:
        try:
            wrapper.__wrapped__ = original
        except Exception:
            pass


def make_call_wrapper(st: HookState, called_as: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The hot path: count, check a precomputed cheap trigger, call through."""
    handler = st.handler

    def kdump_hook(*args: Any, **kwargs: Any) -> Any:
        if st.armed:
            i = next(st.counter)
            if st.consider(i) and not busy.flag:
                busy.flag = True  # hooked calls made inside this one pass through unrecorded
                try:
                    if st.spec.pointer_params:
                        run, a, kw = mark_pointer_params(st, fn, args, kwargs)
                        return handler(st, i, called_as, run, a, kw)  # type: ignore[call-arg]
                    return handler(st, i, called_as, fn, args, kwargs)  # type: ignore[call-arg]
                finally:
                    busy.flag = False
        return fn(*args, **kwargs)

    _copy_metadata(kdump_hook, fn)
    kdump_hook.__kdump_state__ = st  # type: ignore[attr-defined]
    return kdump_hook


def _as_pointers(value: Any) -> Any:
    """Integers (also inside a list or tuple) as `Pointer`s; anything else unchanged."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Pointer(value)
    if isinstance(value, (list, tuple)):
        items = [_as_pointers(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def mark_pointer_params(
    st: HookState, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The call with the raw addresses of the spec's `pointer_params` (another rank's symmetric
    memory) wrapped in `Pointer`, so the recorder writes `$pointer` nodes, and the function that
    runs it with the values the program passed."""
    wanted = set(st.spec.pointer_params)
    names = st.names() or ()
    real: dict[int, Any] = {}

    def mark(name: str, v: Any) -> Any:
        if name not in wanted:
            return v
        marked = _as_pointers(v)
        if marked is not v:
            real[id(marked)] = v
        return marked

    a = tuple(mark(names[k] if k < len(names) else "", v) for k, v in enumerate(args))
    kw = {k: mark(k, v) for k, v in kwargs.items()}
    if not real:
        return fn, args, kwargs

    def run(*args: Any, **kwargs: Any) -> Any:
        args = tuple(real.get(id(v), v) for v in args)
        return fn(*args, **{k: real.get(id(v), v) for k, v in kwargs.items()})

    return run, a, kw


def make_setter_wrapper(
    st: HookState, called_as: str, fn: Callable[..., Any]
) -> Callable[..., Any]:
    handler = st.handler

    def kdump_setter_hook(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)  # a setter that raised changed nothing: nothing to note
        if st.armed:
            try:
                handler(st, called_as, args, kwargs)  # type: ignore[call-arg]
            except Exception as exc:
                st.disarm()
                log_once(f"setter:{st.id}", f"cannot note {called_as}: {exc}; no longer noted")
        return result

    _copy_metadata(kdump_setter_hook, fn)
    kdump_setter_hook.__kdump_state__ = st  # type: ignore[attr-defined]
    return kdump_setter_hook


class OpHook:
    """Callable stand-in for a torch OpOverloadPacket (or one of its overloads)."""

    def __init__(self, st: HookState, called_as: str, op: Any) -> None:
        self._st = st
        self._called_as = called_as
        self._op = op
        self._overloads: dict[str, OpHook] = {}
        self.__kdump_state__ = st
        self.__wrapped__ = op

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        st = self._st
        if st.armed:
            i = next(st.counter)
            if st.consider(i) and not busy.flag:
                busy.flag = True  # as `make_call_wrapper`'s hook
                try:
                    return st.handler(st, i, self._called_as, self._op, args, kwargs)  # type: ignore[call-arg]
                finally:
                    busy.flag = False
        return self._op(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._op, name)
        if name.startswith("_") or name in self._overloads:
            return self._overloads.get(name, value)
        from torch._ops import OpOverload

        if isinstance(value, OpOverload):
            hook = OpHook(self._st, f"{self._called_as}.{name}", value)
            self._st.wrappers.append(hook)
            self._overloads[name] = hook
            return hook
        return value

    def __repr__(self) -> str:
        return f"<kdump hook of {self._op!r}>"


def is_hook(obj: Any) -> bool:
    try:
        return isinstance(obj.__dict__.get("__kdump_state__"), HookState)
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# Resolving and patching

_STATES: dict[int, HookState] = {}  # id(original) -> state, across all patch sets
_lock = threading.RLock()


def _lookup(spec: TargetSpec) -> tuple[Any, str, Any] | None:
    """(container, attribute name, current value) of a target, or None when not loaded yet.
    Never imports anything."""
    if spec.is_op:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        ns_name = spec.module.split(".")[2]
        try:
            ns = getattr(torch.ops, ns_name)
            return ns, spec.qualname, getattr(ns, spec.qualname)
        except (AttributeError, RuntimeError):
            return None  # operator not registered (yet)
    mod = sys.modules.get(spec.module)
    if mod is None:
        return None
    container: Any = mod
    parts = spec.qualname.split(".")
    try:
        for p in parts[:-1]:
            container = getattr(container, p)
        if isinstance(container, type):
            # Class members: the raw descriptor, so static/class methods keep their kind.
            for klass in container.__mro__:
                if parts[-1] in vars(klass):
                    return klass, parts[-1], vars(klass)[parts[-1]]
            return None
        return container, parts[-1], getattr(container, parts[-1])
    except AttributeError:
        return None


def _unwrap_descriptor(value: Any) -> tuple[Any, type | None]:
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__, type(value)
    return value, None


def _display(container: Any, name: str) -> str:
    mod = getattr(container, "__name__", None) or type(container).__name__
    if isinstance(container, type):
        return f"{container.__module__}:{container.__qualname__}.{name}"
    return f"{mod}:{name}"


class PatchSet:
    """The targets one recording session patched. `patch()` is idempotent; `unpatch()` undoes it."""

    def __init__(
        self,
        specs: list[TargetSpec],
        on_call: Handler,
        on_setter: SetterHandler,
        on_patched: Callable[[HookState], None] = lambda st: None,
    ) -> None:
        self.specs = specs
        self.on_call = on_call
        self.on_setter = on_setter
        self.on_patched = on_patched  # lets the session set counter / trigger for a new state
        self.on_change: Callable[[], None] | None = None  # after a rescan resolved a target
        self.states: list[HookState] = []
        self.pending: list[TargetSpec] = list(specs)
        # 'module:*' -> the Triton kernel targets it expanded to once its module was loaded
        self.expanded: dict[str, list[TargetSpec]] = {}
        self._watcher: _ImportWatcher | None = None
        self.active = False

    # -- public ----------------------------------------------------------------------------------
    def patch(self) -> None:
        with _lock:
            self.active = True
            self._resolve_pending()
            if self.pending:
                self._watch()

    def unpatch(self) -> None:
        with _lock:
            self.active = False
            if self._watcher is not None:
                self._watcher.remove()
                self._watcher = None
            for st in self.states:
                st.disarm()
                for ref in reversed(st.refs):
                    try:
                        current = vars(ref.container).get(ref.name, _MISSING)
                        if current is not ref.wrapper:  # someone else rebound it: leave theirs
                            continue
                        if ref.previous is _MISSING:  # an instance attribute we added
                            delattr(ref.container, ref.name)
                        else:
                            setattr(ref.container, ref.name, ref.previous)
                    except Exception as exc:
                        log_once(
                            f"unpatch:{id(ref)}",
                            f"cannot restore {_display(ref.container, ref.name)}: {exc}",
                        )
                st.refs.clear()
                key = triton_launch.innermost(st.original) if st.launch else st.original
                _STATES.pop(id(key), None)
            self._restore_copies()
            self.states.clear()
            self.pending = list(self.specs)
            self.expanded.clear()

    def rescan(self) -> None:
        """Resolve targets whose module appeared and rebind new references (import hook)."""
        with _lock:
            if not self.active:
                return
            before = len(self.pending)
            self._resolve_pending()
            changed = len(self.pending) != before
        if changed and self.on_change is not None:
            self.on_change()

    def report(self) -> list[dict[str, Any]]:
        """Each target's state in this process, for `kdump record`'s summary: `patched` (with
        the folder its module was imported from), `not_imported` (the module never was),
        `missing` (the module is loaded but lacks the attribute) or `not_registered` (an
        operator)."""
        pending = {id(s) for s in self.pending}
        rows: list[dict[str, Any]] = []
        specs: list[TargetSpec] = []
        for spec in self.specs:  # a 'module:*' target, then the kernels it expanded to
            specs.append(spec)
            specs.extend(self.expanded.get(spec.text, ()) if spec.qualname == "*" else ())
        for spec in specs:
            row: dict[str, Any] = {"target": spec.text, "id": spec.id, "module": spec.module}
            if spec.qualname == "*" and id(spec) not in pending:
                row["state"] = "patched" if self.expanded.get(spec.text) else "missing"
            elif id(spec) not in pending:
                row["state"] = "patched"
                root = None if spec.is_op else module_root(sys.modules.get(spec.module))
                if root is not None:
                    row["root"] = root
            elif spec.is_op:
                row["state"] = "not_registered"
            else:
                row["state"] = "missing" if spec.module in sys.modules else "not_imported"
            rows.append(row)
        return rows

    # -- internals -------------------------------------------------------------------------------
    def _resolve_pending(self) -> None:
        still: list[TargetSpec] = []
        new_states = False
        for spec in self._expand(self.pending):
            found = _lookup(spec)
            if found is None:
                if spec.module in sys.modules and not spec.optional and not spec.is_op:
                    log_once(
                        f"missing:{spec.text}",
                        f"target {spec.text}: module is loaded but has no {spec.qualname!r} "
                        "(will retry when more modules load)",
                    )
                still.append(spec)
                continue
            container, name, value = found
            raw, deco = _unwrap_descriptor(value)
            if deco is None and triton_launch.is_kernel(raw):
                self._hook_launch(spec, container, name, raw)
                continue
            if is_hook(raw):
                if raw.__kdump_state__.owner is not self:
                    raise UsageError(f"target {spec.text} is already being recorded")
                continue  # already patched (by us, through an alias, or twice): wrap once
            if not callable(raw):
                log_once(f"notcallable:{spec.text}", f"target {spec.text} is not callable")
                continue
            st = _STATES.get(id(raw))
            if st is not None and st.owner is not self:
                raise UsageError(f"target {spec.text} is already being recorded")
            if st is None:
                handler = self.on_setter if spec.kind == "setter" else self.on_call
                st = HookState(spec, raw, handler, owner=self)  # type: ignore[arg-type]
                _STATES[id(raw)] = st
                self.states.append(st)
                self.on_patched(st)
                new_states = True
            self._replace(st, container, name, value, deco)
        self.pending = still
        if new_states:
            self._scan_modules()

    def _expand(self, pending: list[TargetSpec]) -> list[TargetSpec]:
        """`pending` with each 'module:*' whose module is loaded replaced by the Triton kernels
        it defines (launch_hook.module_kernels); one whose module is not loaded stays."""
        out: list[TargetSpec] = []
        for spec in pending:
            if spec.qualname != "*":
                out.append(spec)
                continue
            mod = sys.modules.get(spec.module)
            if mod is None:
                out.append(spec)  # still pending: the import watcher expands it
                continue
            from kdump.kernels import registry

            names = launch_hook.module_kernels(mod)
            self.expanded[spec.text] = [registry.target_spec(spec.module, n) for n in names]
            if not names:
                log_once(f"noglob:{spec.text}", f"target {spec.text}: defines no Triton kernel")
            out.extend(self.expanded[spec.text])
        return out

    def _hook_launch(self, spec: TargetSpec, container: Any, name: str, kernel: Any) -> None:
        """A Triton kernel: hooked at its innermost object's launch (one state per innermost
        object: a second name for it, or a wrapper of it, records through the first)."""
        jit = triton_launch.innermost(kernel)
        st = _STATES.get(id(jit))
        if st is not None:
            if st.owner is not self:
                raise UsageError(f"target {spec.text} is already being recorded")
            # another wrapper of a hooked kernel: its autotuner's benchmarks stay unrecorded
            made = launch_hook.bench_hooks(kernel)
            st.refs.extend(_Ref(obj, attr, ours, _MISSING) for obj, attr, ours in made)
            return
        called_as = _display(container, name)
        st = HookState(spec, kernel, self.on_call, owner=self, launch=True)
        st.param_names, st._names_known = triton_launch.param_names(jit), True
        try:
            made = launch_hook.install(st, called_as, kernel, busy)
        except Exception as exc:
            log_once(
                f"patch:{called_as}",
                f"cannot hook the launches of {called_as} ({type(exc).__name__}: {exc}); they "
                "are not recorded",
            )
            return
        _STATES[id(jit)] = st
        self.states.append(st)
        self.on_patched(st)
        st.refs.extend(_Ref(obj, attr, ours, _MISSING) for obj, attr, ours in made)

    def _replace(
        self, st: HookState, container: Any, name: str, previous: Any, deco: type | None
    ) -> None:
        called_as = f"{st.spec.module}.{name}" if st.spec.is_op else _display(container, name)
        fn = st.original
        if st.spec.is_op:
            wrapper: Any = OpHook(st, called_as, fn)
        elif st.spec.kind == "setter":
            wrapper = make_setter_wrapper(st, called_as, fn)
        else:
            wrapper = make_call_wrapper(st, called_as, fn)
        st.wrappers.append(wrapper)
        stored = deco(wrapper) if deco is not None else wrapper
        try:
            setattr(container, name, stored)
        except Exception as exc:  # read-only types (C classes), frozen namespaces
            log_once(
                f"patch:{called_as}",
                f"cannot patch {called_as} ({type(exc).__name__}: {exc}); calls through it are "
                "not recorded",
            )
            return
        st.refs.append(_Ref(container, name, stored, previous))

    def _scan_modules(self) -> None:
        """Rebind every module global that IS one of our originals (aliases, copies, caches)."""
        mine = {id(st.original): st for st in self.states if not st.launch}
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or mod_name == "kdump" or mod_name.startswith("kdump."):
                continue
            try:
                d = vars(mod)
            except TypeError:
                continue
            if not isinstance(d, dict):
                continue
            try:
                hits = [(k, v) for k, v in d.items() if id(v) in mine and isinstance(k, str)]
            except RuntimeError:  # dict changed size (another thread importing): one retry
                hits = [(k, v) for k, v in list(d.items()) if id(v) in mine and isinstance(k, str)]
            for k, v in hits:
                st = mine[id(v)]
                if st.original is v:
                    self._replace(st, mod, k, v, None)

    def _restore_copies(self) -> None:
        """Module globals that copied one of our wrappers while patched (vLLM's first-use cache
        during recording) get the original back."""
        mine = {id(w): st for st in self.states for w in st.wrappers}
        if not mine:
            return
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or mod_name == "kdump" or mod_name.startswith("kdump."):
                continue
            try:
                d = vars(mod)
                hits = [(k, v) for k, v in list(d.items()) if id(v) in mine]
            except Exception:
                continue
            for k, v in hits:
                st = mine[id(v)]
                if getattr(v, "__kdump_state__", None) is st:
                    try:
                        setattr(mod, k, st.original)
                    except Exception:
                        pass
        for st in self.states:
            st.wrappers.clear()

    def _watch(self) -> None:
        if self._watcher is None:
            self._watcher = _ImportWatcher(self)
            self._watcher.install()
        self._watcher.names = {s.module for s in self.pending if not s.is_op}
        if any(s.is_op for s in self.pending):
            # An operator may be registered by any library: retry at torch's import and at every
            # watched import (documented: register it before recording starts to be sure).
            self._watcher.names.add("torch")


_MISSING = object()


def module_root(mod: Any) -> str | None:
    """The sys.path folder `mod` was imported from (for `--path`), or None (builtin, namespace
    package, a module made at run time)."""
    import os

    try:
        file = getattr(mod, "__file__", None)
        name = getattr(mod, "__name__", None)
        if not isinstance(file, str) or not isinstance(name, str):
            return None
        base = os.path.dirname(file) if hasattr(mod, "__path__") else file
        for _ in name.split("."):
            base = os.path.dirname(base)
        return os.path.abspath(base)
    except Exception:
        return None


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it finds the real spec through the other finders
    and wraps that loader's `exec_module` (on the loader instance, so its class is unchanged) to
    patch right after the module executed."""

    def __init__(self, patch_set: PatchSet) -> None:
        self.patch_set = patch_set
        self.names: set[str] = set()
        self._inside = threading.local()

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names or getattr(self._inside, "on", False):
            return None
        self._inside.on = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        except Exception:
            return None  # let the normal machinery report it
        finally:
            self._inside.on = False
        loader = getattr(spec, "loader", None) if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        real_exec = loader.exec_module
        watcher = self

        def exec_module(module: Any) -> None:
            try:
                real_exec(module)
            finally:
                try:
                    del loader.exec_module  # back to the class's method
                except AttributeError:
                    pass
            watcher.after_import(fullname)

        try:
            loader.exec_module = exec_module
        except Exception:
            return spec  # cannot hook this loader: the import proceeds untouched
        return spec

    def after_import(self, fullname: str) -> None:
        try:
            self.patch_set.rescan()
            if self.patch_set.pending:
                self.patch_set._watch()
            else:
                self.remove()
        except Exception as exc:
            log_once(f"import:{fullname}", f"patching after import of {fullname} failed: {exc}")
