"""The DeepGEMM plug-in: its hook targets, global state, specs and backends (the installed
library, and kdump's packaged SM120-class kernel that implements the same signatures).

Every line of DeepGEMM is one plug-in: upstream 2.x and its repackagings bind the same names
(names.py), and a call binds by the parameter names of the build that ran it (signature.py,
runtime_bound.py). Targets: the m- and k-grouped GEMMs under every name (FP4 aliases
included), the mega-MoE kernels (recorded with their raw pointers marked, never replayed:
mega.py), the global setters and the locality-domain calls.

Imported by the recorder inside the recorded program: torch and the specs load lazily.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from kdump.kernels.deepgemm import apply, names, state
from kdump.kernels.deepgemm.runtime_bound import loaded_module
from kdump.kernels.deepgemm.signature import positional_names
from kdump.kernels.plugin import Backend, KernelPlugin, KernelSpec, TargetSpec

if TYPE_CHECKING:
    import torch

NAME = "deep_gemm"

# kdump's own kernels with DeepGEMM's signatures: calls recorded there are DeepGEMM calls.
_PACKAGED_MODULES = ("kdump.kernels.sm120.api", "kdump.kernels.sm120.faulty")


def _sm_count(device: torch.device) -> int | None:
    return apply.sm_count(device)


def _call_target(module: str, fn: str) -> TargetSpec:
    """How to hook entry point `fn` of `module`: outputs, positional names (the table's; the
    recorder reads the installed build's through param_names), raw-pointer parameters."""
    canon = names.canonical_name(fn)
    mega = canon in names.DEEPGEMM_MEGA_MOE
    return TargetSpec(
        module,
        fn,
        names.deepgemm_id(fn),
        optional=True,
        output_names=("y",) if mega else ("d",),
        param_names=names.deepgemm_params(canon),
        pointer_params=names.MEGA_MOE_POINTER_PARAMS if mega else (),
    )


class DeepGemmPlugin(KernelPlugin):
    name = NAME
    library_backend = "deep_gemm"

    # --- recording -----------------------------------------------------------------------------
    def presets(self) -> Mapping[str, Sequence[TargetSpec]]:
        out: list[TargetSpec] = []
        for mod in names.DEEPGEMM_MODULES:
            for canon, aliases in names.DEEPGEMM_ENTRY_POINTS.items():
                out += [_call_target(mod, fn) for fn in (canon, *aliases)]
            out += [_call_target(mod, fn) for fn in names.DEEPGEMM_MEGA_MOE]
            for setter in names.DEEPGEMM_SETTERS:
                out.append(
                    TargetSpec(mod, setter, f"{NAME}:{setter}", kind="setter", optional=True)
                )
        return {NAME: tuple(out)}

    def canonical_id(self, target: str) -> str | None:
        module, sep, fn = target.partition(":")
        if not sep:
            if "." not in target:  # a bare function name
                return names.deepgemm_id(target) if target in names.KNOWN_FUNCTIONS else None
            module, _, fn = target.rpartition(".")
        if module in (
            *names.DEEPGEMM_MODULES,
            *_PACKAGED_MODULES,
            "torch.ops.deep_gemm",
            NAME,
        ) and (fn in names.KNOWN_FUNCTIONS):
            return names.deepgemm_id(fn)
        return None

    def target(self, module: str, qualname: str) -> TargetSpec | None:
        if self.canonical_id(f"{module}:{qualname}") is None:
            return None
        return _call_target(module, qualname)

    def param_names(self, target_id: str, fn: Any) -> tuple[str, ...] | None:
        """The installed build's positional names: pybind docstrings, torch.ops schemas, shims
        over an operator (deepgemm/signature.py)."""
        return positional_names(fn)

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
        setters = apply.setters_of(recorded)
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
        notes = apply.unknown_settings(recorded)
        module = loaded_module()  # loaded by the deep_gemm backend; never imported for others
        values = self.settings(recorded)
        sms = _sm_count(device) if values else None
        applied = []
        for key, value in values.items():
            if key not in self.known_settings():
                continue  # settings() yields known names only; this keeps it so
            why = apply.invalid_here(key, value, sms)
            if why is not None:
                notes.append(f"DeepGEMM setting {key}={value!r} not applied: {why}")
                continue
            # The setter's name comes from kdump's table, never from the bundle.
            setter = getattr(module, names.DEEPGEMM_SETTINGS[key], None) if module else None
            if setter is not None:
                try:
                    apply.call_setter(setter, key, value)
                except Exception as exc:
                    notes.append(
                        f"DeepGEMM setting {key}={value!r} not applied: {type(exc).__name__}: {exc}"
                    )
                    continue
            applied.append(f"{key}={value!r}")
        if applied:
            where = "to the library and the contract" if module else "to the contract"
            notes.append(f"recorded DeepGEMM settings applied {where}: {', '.join(applied)}")
        notes += apply.locality_notes(recorded, module)
        notes += apply.build_notes(recorded, module)
        return notes

    def same_build(self, recorded: Mapping[str, Any] | None, backend: Backend) -> bool:
        """The recorded build (distribution, version and commit where both know one) is the
        one the deep_gemm backend runs; bundles without build facts compare versions."""
        if backend.name != self.library_backend:
            return True
        from kdump.kernels.deepgemm import build

        rec = (recorded or {}).get("build")
        module = loaded_module()
        same = build.same(rec, build.module_build(module)) if module is not None else None
        if same is not None:
            return same
        rec_version = (recorded or {}).get("version")
        return not rec_version or rec_version == backend.version()

    def specs(self) -> Sequence[KernelSpec]:
        return self._specs

    @cached_property
    def _specs(self) -> tuple[KernelSpec, ...]:
        from kdump.kernels.deepgemm import kgrouped, mega, specs

        return (
            *(cls() for cls in specs.SPEC_CLASSES),
            *(cls() for cls in kgrouped.SPEC_CLASSES),
            *mega.mega_moe_specs(),
        )

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
        from kdump.kernels.deepgemm import build
        from kdump.kernels.deepgemm.backend import import_deep_gemm
        from kdump.kernels.sm120.backend import packaged_check

        try:
            mod = import_deep_gemm()
            facts = build.module_build(mod)
            line = {
                "name": "backend deep_gemm",
                "ok": gpu,
                "detail": f"DeepGEMM {build.describe(facts)} ({state.api_of(mod) or '?'} API, "
                f"{build.jit_line(mod)} JIT) at {getattr(mod, '__file__', '?')}",
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


PLUGIN = DeepGemmPlugin()
