"""Re-applying DeepGEMM's recorded process-global state before a replayed call.

Known settings only (names.DEEPGEMM_SETTINGS): each is checked against this device, then set
through the setter kdump's table names (never a name taken from the bundle). What cannot be set
is noted: a value invalid here, a setting or setter kdump does not know, the locality-domain
placement (weights `localize`d into the GPU's locality domains replay from ordinary device
memory: the placement is a property of the recorded process's allocations, not a setting), and
a build that differs from the recorded one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kdump.kernels.deepgemm import build, names
from kdump.text import visible

if TYPE_CHECKING:
    import torch

# Keys of the recorded state that describe the library rather than set it.
DESCRIPTIVE = frozenset(
    {"module", "version", "file", "setters", "error", "build", "api", "jit", "locality_domains"}
)


def sm_count(device: torch.device) -> int | None:
    """SMs of `device` (None off the GPU: nothing to check against)."""
    if device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def invalid_here(key: str, value: Any, sms: int | None) -> str | None:
    """Why a recorded setting cannot be applied on this device, or None when it can."""
    if key == "num_sms":
        if not _is_int(value) or value <= 0:
            return f"{value!r} is not a positive SM count"
        if sms is not None and value > sms:
            return f"this GPU has {sms} SMs"
    if key == "mk_alignment" and (not _is_int(value) or value <= 0):
        return f"{value!r} is not a positive alignment"
    if key == "tc_util" and (not _is_int(value) or not 0 < value <= 100):
        return f"{value!r} is not a percentage in 1..100"
    if key == "block_size_multiple_of":
        pair = value if isinstance(value, (list, tuple)) else [value]
        if not 1 <= len(pair) <= 2 or not all(_is_int(v) and v > 0 for v in pair):
            return f"{value!r} is not a positive int or a pair of them"
    if key in ("pdl", "ignore_compile_dims", "deterministic_algorithms") and not isinstance(
        value, bool
    ):
        return f"{value!r} is not a bool"
    return None


def call_setter(setter: Any, key: str, value: Any) -> None:
    if isinstance(value, dict) and set(value) == {"args", "kwargs"}:
        setter(*value["args"], **value["kwargs"])
    elif key == "block_size_multiple_of" and isinstance(value, list):
        setter(value[0] if len(value) == 1 else tuple(value))  # JSON gave back a list
    else:
        setter(value)


def setters_of(recorded: Mapping[str, Any]) -> Mapping[str, Any]:
    setters = recorded.get("setters")
    return setters if isinstance(setters, Mapping) else {}


def unknown_settings(recorded: Mapping[str, Any] | None) -> list[str]:
    """A note naming the recorded settings and setters kdump does not know (shown, not run)."""
    if not isinstance(recorded, Mapping):
        return []
    setters = setters_of(recorded)
    unknown = [k for k in recorded if k not in DESCRIPTIVE and k not in names.DEEPGEMM_SETTINGS]
    unknown += [k for k in setters if k not in names.DEEPGEMM_SETTERS]
    if not unknown:
        return []
    shown = ", ".join(visible(k, 80) for k in sorted(map(str, unknown))[:20])
    return [f"recorded DeepGEMM settings unknown to kdump, not applied: {shown}"]


def locality_notes(recorded: Mapping[str, Any] | None, module: Any) -> list[str]:
    """What the recording's locality-domain calls mean for this replay."""
    if not isinstance(recorded, Mapping):
        return []
    setters = setters_of(recorded)
    localize = setters.get("localize") or setters.get("localize_rows")
    if not isinstance(localize, Mapping):
        return []
    last = localize.get("last") if isinstance(localize.get("last"), Mapping) else {}
    tensor = last.get("tensor") if isinstance(last, Mapping) else None
    shape = tensor.get("shape") if isinstance(tensor, Mapping) else None
    domains = recorded.get("locality_domains")
    text = (
        f"the recording placed weights in the GPU's locality domains (deep_gemm.localize "
        f"called {visible(str(localize.get('calls', '?')), 20)} time(s), last on shape "
        f"{visible(str(shape), 60)}"
        + (f" along dim {visible(str(last['dim']), 10)}" if "dim" in last else "")
        + (f", {visible(str(domains), 20)} domains" if _is_int(domains) else "")
        + "); this replay's tensors are ordinary device memory"
    )
    notes = [text]
    here = getattr(module, "get_num_locality_domains", None) if module is not None else None
    if _is_int(domains) and here is not None:
        try:
            n = int(here())
        except Exception:
            return notes
        if n != domains:
            notes.append(f"locality domains differ: recorded {domains}, here {n}")
    return notes


def build_notes(recorded: Mapping[str, Any] | None, module: Any) -> list[str]:
    """A note when the build here is not the recorded one (line, version or commit)."""
    if not isinstance(recorded, Mapping) or module is None:
        return []
    rec_build = recorded.get("build")
    here = build.module_build(module)
    same = build.same(rec_build if isinstance(rec_build, dict) else None, here)
    if same is False:
        return [
            f"DeepGEMM build differs: recorded {visible(build.describe(rec_build), 120)}, "
            f"here {visible(build.describe(here), 120)}"
        ]
    rec_version = recorded.get("version")
    here_version = getattr(module, "__version__", None)
    if same is None and rec_version and here_version and str(rec_version) != str(here_version):
        return [
            f"DeepGEMM version differs: recorded {visible(str(rec_version), 60)}, "
            f"here {visible(str(here_version), 60)}"
        ]
    return []
