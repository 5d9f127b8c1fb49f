"""Where kernel-library plug-ins are found, and the one place that maps a target, a spec or a
backend name to its plug-in.

Built-in plug-ins load directly (kdump also runs from a source checkout without installed
metadata); third-party ones come from the entry-point group "kdump.kernels", whose entry points
resolve to a KernelPlugin instance or class. A plug-in that fails to load is logged once and
skipped. Importing this module does not import torch (the recorder uses it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from functools import lru_cache
from importlib import metadata
from typing import TYPE_CHECKING, Any

from kdump.errors import CannotRunError, UntrustedTargetError, UsageError
from kdump.kernels.plugin import Backend, KernelPlugin, KernelSpec, TargetSpec

if TYPE_CHECKING:
    import torch

ENTRY_POINT_GROUP = "kdump.kernels"
GENERIC_BACKENDS = ("reference", "library")  # tried last by `auto`, in this order


def _builtin() -> list[KernelPlugin]:
    from kdump.kernels.deepgemm.plugin import PLUGIN

    return [PLUGIN]


def _warn(message: str) -> None:
    try:
        sys.stderr.write(f"kdump: {message}\n")
    except Exception:
        pass


_warned: set[str] = set()


def _skip(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _warn(message)


def _from_entry_point(ep: Any) -> KernelPlugin | None:
    try:
        obj = ep.load()
        if isinstance(obj, type) and issubclass(obj, KernelPlugin):
            obj = obj()
        if not isinstance(obj, KernelPlugin) or not obj.name:
            raise TypeError(f"{type(obj).__name__} is not a named KernelPlugin")
        return obj
    except Exception as exc:  # a broken third-party plug-in never breaks kdump
        _skip(
            ep.name, f"kernel plug-in {ep.name!r} ({ep.value}) skipped: {type(exc).__name__}: {exc}"
        )
        return None


@lru_cache(maxsize=1)
def plugins() -> tuple[KernelPlugin, ...]:
    """Every plug-in, built-in ones first, de-duplicated by name."""
    found: dict[str, KernelPlugin] = {p.name: p for p in _builtin()}
    try:
        eps = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as exc:
        _skip("<entry points>", f"kernel plug-ins not searched: {type(exc).__name__}: {exc}")
        eps = []
    for ep in eps:
        if ep.name in found:
            continue  # the built-in copy (or an earlier duplicate) wins
        plugin = _from_entry_point(ep)
        if plugin is not None:
            found.setdefault(plugin.name, plugin)
    return tuple(found.values())


def reload() -> None:
    """Search the plug-ins again (after sys.path or installed metadata changed)."""
    plugins.cache_clear()
    _backend_index.cache_clear()


def plugin(name: str) -> KernelPlugin | None:
    return next((p for p in plugins() if p.name == name), None)


# --- targets ------------------------------------------------------------------------------------
def canonical_id(target: str) -> str:
    """'<plugin>:<function>' for a target a plug-in knows (by any alias or binding module);
    'module:qualname' otherwise ('module.attr' for torch.ops becomes 'module:attr')."""
    for p in plugins():
        canon = p.canonical_id(target)
        if canon:
            return canon
    module, sep, name = target.partition(":")
    if not sep:
        module, _, name = target.rpartition(".")
    return f"{module}:{name}" if module else name


def plugin_for(target: str) -> KernelPlugin | None:
    """The plug-in a target (or canonical id) belongs to."""
    return plugin(canonical_id(target).partition(":")[0])


def claiming_plugin(target: str) -> KernelPlugin | None:
    """The plug-in that recognises `target` as one of its own functions (not merely a name that
    starts with the plug-in's: 'deep_gemm:os.system' belongs to no plug-in)."""
    return next((p for p in plugins() if p.canonical_id(target)), None)


_GLOB_CHARS = frozenset("*?[")
# How a target was admitted: a plug-in's own function or an exact --allow-target name (that
# attribute, whatever it is), or only by a glob (then only what the target's module defines).
EXACT, GLOB = "exact", "glob"
# The patterns each target was last admitted under in this process (check_target), so that the
# replay child resolves it under the same rule where the object exists (resolve_allowed).
_admitted: dict[str, tuple[str, ...]] = {}


def admission(target: str, allowed: Sequence[str] = ()) -> str | None:
    """EXACT when `target` is a plug-in's function or named exactly by an allowed pattern, GLOB
    when only a glob pattern matches it, None when replay may not run it. Patterns: `allowed`
    (e.g. --allow-target) and allow-targets of the user's config file."""
    if claiming_plugin(target) is not None:
        return EXACT
    from kdump import config

    names = {target, canonical_id(target)}
    patterns = (*allowed, *config.allowed_targets())
    if any(pat in names for pat in patterns if not _GLOB_CHARS.intersection(pat)):
        return EXACT
    if any(fnmatchcase(n, pat) for pat in patterns for n in names):
        return GLOB
    return None


def target_allowed(target: str, allowed: Sequence[str] = ()) -> bool:
    """Whether replay may run `target` by its name: a registered plug-in's target, or one the
    user allowed (`allowed` patterns, e.g. from --allow-target, and the user's config file).
    What the name resolves to is checked where it is imported (`resolve_allowed`)."""
    return admission(target, allowed) is not None


def _untrusted(target: str, why: str = "") -> UntrustedTargetError:
    from kdump import config
    from kdump.text import visible

    shown = visible(target, 200)
    if why:
        return UntrustedTargetError(f"the bundle asks to run {shown}, {why}")
    return UntrustedTargetError(
        f"the bundle asks to run {shown}, which is no kernel plug-in's; if you trust the bundle, "
        f"pass --allow-target '{shown}' (or list it in allow-targets of {config.config_path()})"
    )


def check_target(target: str, allowed: Sequence[str] = ()) -> None:
    """Raise UntrustedTargetError unless replay may run `target` (the one trust rule: a bundle
    names what it wants to call; kdump runs only plug-in targets and what the user allowed).
    The patterns it was admitted under are kept for `resolve_allowed` in this process."""
    if admission(target, allowed) is None:
        raise _untrusted(target)
    _admitted[target] = tuple(allowed)


def resolve_allowed(target: str, allowed: Sequence[str] | None = None) -> Any:
    """Import `target` ('module:qualname') and return the object it names, under the trust rule:
    the qualname's walk never steps through a module object (so 'mymod:os.system' is refused
    whatever the patterns say), and a target admitted only by a glob must be defined by its
    module (its `__module__`, or its `__wrapped__` function's, is the module or a submodule).
    `allowed`: the user's patterns; None: those `check_target` admitted it under here.
    Raises UntrustedTargetError (refused) or CannotRunError (not importable here)."""
    patterns = _admitted.get(target, ()) if allowed is None else tuple(allowed)
    how = admission(target, patterns)
    if how is None:
        raise _untrusted(target)
    module, _, qualname = target.partition(":")
    if not qualname:
        raise UsageError(f"target {_visible(target)} is not 'module:qualname'")
    obj = _walk(target, module, qualname)
    if how == GLOB and not defined_in(obj, module):
        shown = _visible(target)
        raise _untrusted(
            target,
            f"which {_visible(module)} does not define (it is {_origin(obj)}); a glob pattern "
            f"covers only what its module defines: pass --allow-target '{shown}' if you trust it",
        )
    return obj


def _visible(text: str) -> str:
    from kdump.text import visible

    return visible(text, 200)


def _walk(target: str, module: str, qualname: str) -> Any:
    """The object `qualname` names in `module`, one attribute at a time; an attribute that is
    a module (one `module` merely imported) ends the walk as untrusted."""
    import importlib
    import types

    if module == "torch.ops" or module.startswith("torch.ops."):
        import torch

        obj: Any = torch.ops
        for part in module.split(".")[2:]:
            obj = _attr(obj, part, target, module)
    else:
        try:
            obj = importlib.import_module(module)
        except ImportError as exc:
            raise CannotRunError(
                f"cannot import {_visible(module)} to replay {_visible(target)}: {exc}; the "
                "replay imports only from the environment it runs in and the --path folders: "
                "pass --path DIR with the folder that holds it"
            ) from None
    parts = qualname.split(".")
    for k, part in enumerate(parts):
        obj = _attr(obj, part, target, module)
        if k < len(parts) - 1 and isinstance(obj, types.ModuleType) and not _op_namespace(obj):
            through = ".".join(parts[: k + 1])
            raise _untrusted(
                target,
                f"which reaches through the module object {_visible(module)}.{_visible(through)} "
                f"({_visible(obj.__name__)}); kdump never resolves a target through a module "
                "that another one imports, whatever the allowed patterns",
            )
    return obj


def _attr(obj: Any, part: str, target: str, module: str) -> Any:
    try:
        return getattr(obj, part)
    except AttributeError:
        raise CannotRunError(
            f"{_visible(target)}: {_visible(part)!r} not found in the installed {_visible(module)}"
        ) from None


def _op_namespace(obj: Any) -> bool:
    """torch.ops namespaces are module objects that hold only registered operators."""
    ops = sys.modules.get("torch._ops")
    return ops is not None and isinstance(obj, ops._OpNamespace)


def defined_in(obj: Any, module: str) -> bool:
    """Whether `module` (or a submodule of it) defines `obj`: its `__module__`, or for a wrapper
    its `__wrapped__` function's, or for a Triton kernel object (whose class is Triton's) its
    innermost Python function's; a torch.ops target's operators belong to their namespace."""
    if module == "torch.ops" or module.startswith("torch.ops."):
        ops = sys.modules.get("torch._ops")
        return ops is not None and isinstance(obj, (ops.OpOverloadPacket, ops.OpOverload))
    import types

    if isinstance(obj, types.ModuleType):
        return False
    from kdump.kernels.triton import launch as triton_launch

    cands = [obj, getattr(obj, "__wrapped__", None)]
    if triton_launch.is_kernel(obj):
        cands.append(triton_launch.python_function(triton_launch.innermost(obj)))
    for cand in cands:
        owner = getattr(cand, "__module__", None) if cand is not None else None
        if isinstance(owner, str) and (owner == module or owner.startswith(module + ".")):
            return True
    return False


def _origin(obj: Any) -> str:
    owner = getattr(obj, "__module__", None)
    kind = type(obj).__name__
    return f"a {kind} of {owner}" if isinstance(owner, str) else f"a {kind}"


def presets() -> dict[str, tuple[TargetSpec, ...]]:
    out: dict[str, tuple[TargetSpec, ...]] = {}
    for p in plugins():
        for name, specs in p.presets().items():
            out.setdefault(name, tuple(specs))
    return out


def target_spec(module: str, qualname: str) -> TargetSpec:
    """How to hook an explicitly named target: a plug-in's details, else a generic target."""
    canon = canonical_id(f"{module}:{qualname}")
    p = plugin(canon.partition(":")[0])
    spec = p.target(module, qualname) if p is not None else None
    return spec or TargetSpec(module, qualname, canon)


def note_setter(
    target_id: str, qualname: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """A hooked setter returned: its plug-in keeps the value for the library's state."""
    try:
        p = plugin(target_id.partition(":")[0])
        if p is not None:
            p.note_setter(target_id, qualname, args, kwargs)
    except Exception as exc:  # recording never breaks the program
        _skip(f"setter {target_id}", f"setter {target_id} not noted: {type(exc).__name__}: {exc}")


def library_states() -> dict[str, Any]:
    """Each plug-in's global state (loaded libraries only); errors are recorded, not raised."""
    out: dict[str, Any] = {}
    for p in plugins():
        try:
            st = p.state()
        except Exception as exc:
            st = {"error": f"{type(exc).__name__}: {exc}"}
        if st is not None:
            out[p.name] = st
    return out


# --- specs --------------------------------------------------------------------------------------
def all_specs() -> list[KernelSpec]:
    """One instance of every plug-in's specs (default settings)."""
    return [s for p in plugins() for s in p.specs()]


def spec_for(
    target: str,
    names: Sequence[str] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> KernelSpec:
    """The spec of `target` ('module:qualname', a canonical id, or a bare function name a plug-in
    knows), configured with the library's `settings`; a GenericSpec (positional `names`) for
    anything else."""
    from kdump.kernels.generic import GenericSpec

    canon = canonical_id(target)
    p = plugin(canon.partition(":")[0])
    spec = p.spec(canon) if p is not None else None
    if spec is None:
        return GenericSpec(target, names)
    return spec.with_settings(settings).with_names(names)


def recorded_state(
    p: KernelPlugin, env: Mapping[str, Any], meta: Mapping[str, Any]
) -> Mapping[str, Any] | None:
    """A library's state when the call was recorded: the call's own, else the bundle's."""
    per_call = (meta.get("library_state") or {}).get(p.name)
    return per_call if per_call else (env.get("libraries") or {}).get(p.name)


# --- backends -----------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _backend_index() -> dict[str, tuple[Backend, KernelPlugin | None]]:
    from kdump.kernels.generic import LibraryBackend, ReferenceBackend

    index: dict[str, tuple[Backend, KernelPlugin | None]] = {
        "reference": (ReferenceBackend(), None),
        "library": (LibraryBackend(resolve_allowed), None),
    }
    for p in plugins():
        try:
            backends = list(p.backends())
        except Exception as exc:
            _skip(f"{p.name} backends", f"backends of plug-in {p.name!r} skipped: {exc}")
            continue
        for b in backends:
            index.setdefault(b.name, (b, p))
    return index


def backend_names() -> tuple[str, ...]:
    """Every `--backend` choice: auto, the generic ones, then each plug-in's."""
    return ("auto", *_backend_index())


def get_backend(name: str) -> Backend:
    try:
        return _backend_index()[name][0]
    except KeyError:
        raise UsageError(
            f"unknown backend {name!r}; choose one of {', '.join(backend_names())}"
        ) from None


def backend_plugin(name: str) -> KernelPlugin | None:
    """The plug-in that brings backend `name` (None for the generic ones)."""
    entry = _backend_index().get(name)
    return entry[1] if entry else None


def auto_order(spec: KernelSpec) -> list[str]:
    p = plugin(spec.library() or spec.id.partition(":")[0])
    first = list(p.auto_order()) if p is not None else []
    return [*first, *(g for g in GENERIC_BACKENDS if g not in first)]


def choose_backend(name: str, spec: KernelSpec, device: torch.device) -> Backend:
    """Resolve 'auto' (the spec's plug-in order, e.g. the installed library then the packaged
    kernel on a GPU; then the reference; then the recorded target) and check that the chosen
    backend can run here."""
    if name != "auto":
        backend = get_backend(name)
        ok, why = backend.available(spec, device)
        if not ok:
            raise CannotRunError(f"backend {name} cannot run {spec.id} here: {why}")
        return backend
    index = _backend_index()
    for cand in auto_order(spec):
        if cand in index and index[cand][0].available(spec, device)[0]:
            return index[cand][0]
    raise CannotRunError(f"no backend can run {spec.id} on {device}")
