"""Which spec handles a recorded target: by canonical id and aliases, else GenericSpec."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from kdump.kernels.deepgemm.names import canonical_id, deepgemm_id
from kdump.kernels.plugin import GenericSpec, KernelSpec


@lru_cache(maxsize=1)
def _index() -> dict[str, KernelSpec]:
    from kdump.kernels.deepgemm.specs import SPEC_CLASSES

    index: dict[str, KernelSpec] = {}
    for cls in SPEC_CLASSES:
        spec = cls()
        index[spec.id] = spec
        for alias in spec.aliases:
            index[deepgemm_id(alias)] = spec
            index[f"deep_gemm:{alias}"] = spec
    return index


def all_specs() -> list[KernelSpec]:
    """One instance of every dedicated spec (default settings)."""
    seen: dict[str, KernelSpec] = {}
    for spec in _index().values():
        seen.setdefault(spec.id, spec)
    return list(seen.values())


def spec_for(
    target: str,
    names: Sequence[str] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> KernelSpec:
    """The spec of `target` ('module:qualname', a canonical id such as
    'deep_gemm:m_grouped_fp8_gemm_nt_contiguous', or a bare DeepGEMM function name), configured
    with the library's recorded `settings`; a GenericSpec (positional `names`) for anything
    else."""
    index = _index()
    spec = index.get(canonical_id(target)) or index.get(target)
    if spec is None and ":" not in target and "." not in target:
        spec = index.get(deepgemm_id(target))
    if spec is None:
        return GenericSpec(target, names)
    return spec.with_settings(settings)
