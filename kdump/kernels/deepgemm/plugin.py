"""The DeepGEMM plug-in: its hook targets, global state, specs and backends (the installed
library, and kdump's packaged SM120-class kernel that implements the same signatures).

Imported by the recorder inside the recorded program: torch and the specs load lazily.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from kdump.kernels.deepgemm import names, state
from kdump.kernels.plugin import Backend, KernelPlugin, KernelSpec, TargetSpec

if TYPE_CHECKING:
    import torch

NAME = "deep_gemm"


def _loaded_module() -> Any:
    return next((sys.modules[m] for m in names.DEEPGEMM_MODULES if m in sys.modules), None)


def _sm_count(device: torch.device) -> int | None:
    """SMs of `device` (None off the GPU: nothing to check against)."""
    if device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _invalid_here(key: str, value: Any, sm_count: int | None) -> str | None:
    """Why a recorded setting cannot be applied on this device, or None when it can."""
    if key == "num_sms":
        if not _is_int(value) or value <= 0:
            return f"{value!r} is not a positive SM count"
        if sm_count is not None and value > sm_count:
            return f"this GPU has {sm_count} SMs"
    if key == "mk_alignment" and (not _is_int(value) or value <= 0):
        return f"{value!r} is not a positive alignment"
    if key == "tc_util" and (not _is_int(value) or not 0 < value <= 100):
        return f"{value!r} is not a percentage in 1..100"
    return None


def _call_setter(setter: Any, value: Any) -> None:
    if isinstance(value, dict) and set(value) == {"args", "kwargs"}:
        setter(*value["args"], **value["kwargs"])
    else:
        setter(value)


# Keys of the recorded state that describe the library rather than set it.
_DESCRIPTIVE = frozenset({"module", "version", "file", "setters", "error"})


def _setters(recorded: Mapping[str, Any]) -> Mapping[str, Any]:
    setters = recorded.get("setters")
    return setters if isinstance(setters, Mapping) else {}


def _unknown_settings(recorded: Mapping[str, Any] | None) -> list[str]:
    """A note naming the recorded settings and setters kdump does not know (shown, not run)."""
    if not isinstance(recorded, Mapping):
        return []
    setters = _setters(recorded)
    unknown = [k for k in recorded if k not in _DESCRIPTIVE and k not in names.DEEPGEMM_SETTINGS]
    unknown += [k for k in setters if k not in names.DEEPGEMM_SETTERS]
    if not unknown:
        return []
    from kdump.text import visible

    shown = ", ".join(visible(k, 80) for k in sorted(map(str, unknown))[:20])
    return [f"recorded DeepGEMM settings unknown to kdump, not applied: {shown}"]


# kdump's own kernels with DeepGEMM's signatures: calls recorded there are DeepGEMM calls.
_PACKAGED_MODULES = ("kdump.kernels.sm120.api", "kdump.kernels.sm120.faulty")


class DeepGemmPlugin(KernelPlugin):
    name = NAME
    library_backend = "deep_gemm"

    # --- recording -----------------------------------------------------------------------------
    def presets(self) -> Mapping[str, Sequence[TargetSpec]]:
        out: list[TargetSpec] = []
        for mod in names.DEEPGEMM_MODULES:
            for canon, aliases in names.DEEPGEMM_ENTRY_POINTS.items():
                for fn in (canon, *aliases):
                    out.append(
                        TargetSpec(
                            mod,
                            fn,
                            names.deepgemm_id(fn),
                            optional=True,
                            output_names=("d",),
                            param_names=names.deepgemm_params(canon),
                        )
                    )
            for setter in names.DEEPGEMM_SETTERS:
                out.append(
                    TargetSpec(mod, setter, f"{NAME}:{setter}", kind="setter", optional=True)
                )
        return {NAME: tuple(out)}

    def canonical_id(self, target: str) -> str | None:
        module, sep, fn = target.partition(":")
        if not sep:
            if "." not in target:  # a bare function name
                return names.deepgemm_id(target) if target in _KNOWN else None
            module, _, fn = target.rpartition(".")
        if module in (
            *names.DEEPGEMM_MODULES,
            *_PACKAGED_MODULES,
            "torch.ops.deep_gemm",
            NAME,
        ) and (fn in _KNOWN):
            return names.deepgemm_id(fn)
        return None

    def target(self, module: str, qualname: str) -> TargetSpec | None:
        canon = self.canonical_id(f"{module}:{qualname}")
        if canon is None:
            return None
        return TargetSpec(
            module,
            qualname,
            canon,
            output_names=("d",),
            param_names=names.deepgemm_params(canon.partition(":")[2]),
        )

    def state(self) -> dict[str, Any] | None:
        return state.state()

    def note_setter(
        self, target_id: str, qualname: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        state.note_setter(qualname, args, kwargs)

    # --- replay --------------------------------------------------------------------------------
    def settings(self, recorded: Mapping[str, Any] | None) -> dict[str, Any]:
        """Getter values (the truth at record time), completed by the latest setter arguments
        (setters without a getter)."""
        if not isinstance(recorded, Mapping):
            return {}  # nothing, or a bundle's garbage
        setters = _setters(recorded)
        out: dict[str, Any] = {}
        for key, setter in names.DEEPGEMM_SETTINGS.items():
            value = recorded.get(key)
            if value is None or (isinstance(value, dict) and "error" in value):
                value = setters.get(setter)
            if value is not None:
                out[key] = value
        return out

    def known_settings(self) -> frozenset[str]:
        return frozenset(names.DEEPGEMM_SETTINGS)

    def apply_state(self, recorded: Mapping[str, Any] | None, device: torch.device) -> list[str]:
        notes = _unknown_settings(recorded)
        values = self.settings(recorded)
        if not values:
            return notes
        sms = _sm_count(device)
        module = _loaded_module()  # loaded by the deep_gemm backend; never imported for others
        applied = []
        for key, value in values.items():
            if key not in self.known_settings():
                continue  # settings() yields known names only; this keeps it so
            why = _invalid_here(key, value, sms)
            if why is not None:
                notes.append(f"DeepGEMM setting {key}={value!r} not applied: {why}")
                continue
            # The setter's name comes from kdump's table, never from the bundle.
            setter = getattr(module, names.DEEPGEMM_SETTINGS[key], None) if module else None
            if setter is not None:
                try:
                    _call_setter(setter, value)
                except Exception as exc:
                    notes.append(
                        f"DeepGEMM setting {key}={value!r} not applied: {type(exc).__name__}: {exc}"
                    )
                    continue
            applied.append(f"{key}={value!r}")
        if applied:
            where = "to the library and the contract" if module else "to the contract"
            notes.append(f"recorded DeepGEMM settings applied {where}: {', '.join(applied)}")
        rec_version = (recorded or {}).get("version")
        here = getattr(module, "__version__", None) if module else None
        if rec_version and here and str(rec_version) != str(here):
            notes.append(f"DeepGEMM version differs: recorded {rec_version}, here {here}")
        return notes

    def same_build(self, recorded: Mapping[str, Any] | None, backend: Backend) -> bool:
        if backend.name != self.library_backend:
            return True
        rec_version = (recorded or {}).get("version")
        return not rec_version or rec_version == backend.version()

    def specs(self) -> Sequence[KernelSpec]:
        return self._specs

    @cached_property
    def _specs(self) -> tuple[KernelSpec, ...]:
        from kdump.kernels.deepgemm.specs import SPEC_CLASSES

        return tuple(cls() for cls in SPEC_CLASSES)

    def spec(self, target_id: str) -> KernelSpec | None:
        canon = self.canonical_id(target_id) or target_id
        return next((s for s in self.specs() if s.id == canon), None)

    def backends(self) -> Sequence[Backend]:
        return self._backends

    @cached_property
    def _backends(self) -> tuple[Backend, ...]:
        from kdump.kernels.deepgemm.backend import DeepGemmBackend
        from kdump.kernels.sm120.backend import FaultyPackagedBackend, PackagedBackend

        return (DeepGemmBackend(), PackagedBackend(), FaultyPackagedBackend())

    def auto_order(self) -> Sequence[str]:
        return ("deep_gemm", "packaged")

    def checks(self, gpu: bool) -> list[dict[str, Any]]:
        from kdump.kernels.deepgemm.backend import import_deep_gemm
        from kdump.kernels.sm120.backend import packaged_check

        try:
            mod = import_deep_gemm()
            line = {
                "name": "backend deep_gemm",
                "ok": gpu,
                "detail": f"DeepGEMM {getattr(mod, '__version__', '?')} at "
                f"{getattr(mod, '__file__', '?')}",
                "fix": "" if gpu else "needs a CUDA GPU",
            }
        except Exception as exc:
            line = {
                "name": "backend deep_gemm",
                "ok": False,
                "detail": str(exc).split(";")[0],
                "fix": "pip install the DeepGEMM build the bundle was recorded with "
                "(e.g. sgl-deep-gemm)",
            }
        return [line, packaged_check(gpu)]


_KNOWN = frozenset(
    [*names.DEEPGEMM_ENTRY_POINTS, *(a for al in names.DEEPGEMM_ENTRY_POINTS.values() for a in al)]
)

PLUGIN = DeepGemmPlugin()
