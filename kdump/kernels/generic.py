"""What every target has without a plug-in of its own: the generic spec, the "library" backend
(runs the recorded target itself) and the "reference" backend (runs any spec's torch reference)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kdump.errors import CannotRunError
from kdump.format.records import LaunchRecord
from kdump.kernels.plugin import Backend, KernelSpec
from kdump.kernels.triton import replay as triton_replay


class GenericSpec(KernelSpec):
    """Any target without a dedicated spec: no reference; outputs are the tensors the bundle
    recorded after the call (or none). `launch`: the call's launch record when the target is a
    JIT kernel (a Triton kernel is launched again as recorded, not called)."""

    def __init__(
        self,
        target: str,
        names: Sequence[str] | None = None,
        launch: LaunchRecord | None = None,
    ) -> None:
        self.id = target
        self._names = list(names or [])
        self.launch = launch

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        bound = {
            (self._names[i] if i < len(self._names) else f"args[{i}]"): a
            for i, a in enumerate(args)
        }
        bound.update(kwargs)
        return bound


class ReferenceBackend(Backend):
    """The spec's torch reference, written into the outputs' meaningful elements only (elements
    the kernel does not promise to write are left untouched, as on SM120)."""

    name = "reference"

    def available(self, spec: KernelSpec, device: torch.device) -> tuple[bool, str]:
        if not spec.has_reference():
            return False, f"{spec.id} has no torch reference; use --backend library"
        return True, ""

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> None:
            bound = spec.bind(args, kwargs)
            expected = spec.reference(bound)
            for name, value in expected.items():
                out = bound[name]
                mask = spec.meaningful(bound, name)
                value = value.to(out.device, out.dtype)
                if mask is None:
                    out.copy_(value)
                else:
                    out.copy_(torch.where(mask.to(out.device).expand(out.shape), value, out))

        return run

    def version(self) -> str | None:
        return f"torch {torch.__version__}"


class LibraryBackend(Backend):
    """The recorded target itself, imported by its 'module:qualname' (generic targets); for a
    recorded Triton launch, the installed kernel launched with the recorded grid and launch
    options (kdump.kernels.triton.replay).

    `find` is the trust rule the replay admitted the target by, handed in by the registry that
    builds this backend (`registry.resolve_allowed`: never through a module object; a
    glob-allowed target must be defined by its module): 'module:qualname' -> the object."""

    name = "library"

    def __init__(self, find: Callable[[str], Any]) -> None:
        self._find = find

    def available(self, spec: KernelSpec, device: torch.device) -> tuple[bool, str]:
        return True, ""

    def resolve(self, spec: KernelSpec, target: str) -> Callable[..., Any]:
        """The recorded target, resolved under the trust rule the replay admitted it by."""
        launch = getattr(spec, "launch", None)
        if triton_replay.is_triton_launch(launch):
            assert launch is not None
            kernel = triton_replay.kernel_for(target, self._find(target))
            return triton_replay.runner(kernel, launch)
        return _checked_signature(self._find(target), target)


def _checked_signature(fn: Any, target: str) -> Any:
    """`fn`, refusing (cannot run: the installed code is not the recorded one) a call its
    signature does not accept, before it runs; a TypeError the call itself raises stays the
    kernel's error."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and extension functions without a signature
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise CannotRunError(
                f"the installed {target} does not accept the recorded arguments ({exc}); its "
                "signature changed since the recording"
            ) from None
        return fn(*args, **kwargs)

    return run
