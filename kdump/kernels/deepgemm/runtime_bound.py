"""What every DeepGEMM spec shares: binding by the runtime signature, and the epilogue refusal.

Where a call's positional names come from, best first:

1. the bundle: the names recorded with the call (`with_names`), which are the runtime
   signature of the build that ran it once the recorder reads it through the plug-in
   (KernelPlugin.param_names);
2. the build loaded in this process (the recorded program itself, or a replay whose backend
   imported DeepGEMM): its entry point's runtime signature (deepgemm/signature.py);
3. the spec's table (upstream's order).

A table alone is wrong for a build whose order differs (sgl-deep-gemm's k-grouped
`use_padded_sf_layout` sits where upstream has `epilogue`), which is why it comes last.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kdump.kernels.deepgemm.binding import binder
from kdump.kernels.deepgemm.names import DEEPGEMM_MODULES, aliases_of
from kdump.kernels.deepgemm.refusal import epilogue_refusal
from kdump.kernels.deepgemm.signature import positional_names
from kdump.kernels.plugin import Param

# id(function object) -> (the object, its positional names): the object is held so that its id
# is not reused while the entry stands.
_LIVE: dict[int, tuple[Any, tuple[str, ...] | None]] = {}
_LIVE_LOCK = threading.Lock()


def loaded_module() -> Any:
    """The DeepGEMM module this process has imported (never imports one)."""
    return next((sys.modules[m] for m in DEEPGEMM_MODULES if m in sys.modules), None)


def live_names(function: str) -> tuple[str, ...] | None:
    """Positional names of `function` (or an alias) in the loaded DeepGEMM, if any."""
    module = loaded_module()
    if module is None:
        return None
    for name in (function, *aliases_of(function)):
        fn = getattr(module, name, None)
        if fn is None:
            continue
        with _LIVE_LOCK:
            hit = _LIVE.get(id(fn))
        if hit is not None and hit[0] is fn:
            return hit[1]
        names = positional_names(fn)
        with _LIVE_LOCK:
            _LIVE[id(fn)] = (fn, names)
        return names
    return None


class RuntimeBound:
    """Mixin for DeepGEMM specs: `bind` by the runtime's positional names (see the module
    docstring), `with_names`, and the epilogue refusal. Needs `id`, `function`, `params`."""

    id: str = ""
    function: str = ""
    params: tuple[Param, ...] = ()
    _names: tuple[str, ...] | None = None

    def with_names(self, names: Sequence[str] | None) -> Any:
        names_t = tuple(names) if names else None
        if names_t is None or names_t == self._names:
            return self
        spec = copy.copy(self)  # a shallow copy: the spec's settings stay as they are
        spec._names = names_t
        return spec

    def positional_names(self) -> tuple[str, ...] | None:
        """The names positional arguments bind to (None: the spec's table)."""
        return self._names or live_names(self.function)

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments by parameter name: runtime names mapped onto the spec (binding.Binder),
        unknown ones kept as given, defaults applied."""
        return binder(self.id, self.params, self.positional_names()).bind(args, kwargs)

    def refusal(self, bound: Mapping[str, Any]) -> str | None:
        return epilogue_refusal(self.id, bound.get("epilogue"))
