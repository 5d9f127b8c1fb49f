"""A bundle whose process died of a GPU fault at its call: when the plain replay (eager or the
graph chain) finds nothing, the same chain runs again under compute-sanitizer memcheck with the
caching allocator off, and the verdict says that production crashed here.

The stray accesses that killed production often land in mapped memory in a replay process (other
allocations sit elsewhere), so they go unseen there; memcheck sees every access outside an
allocation. The bundle says its call is where production died: salvage marks the last recorded
call of the faulting process on its stream or graph, and a call still in flight, with
`meta["crash"]["at_this_call"]`."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

# What a GPU fault looks like in a CUDA error, an exception or the tail of stderr.
_FAULT = re.compile(
    r"illegal memory access|illegal address|unspecified launch failure|misaligned address|"
    r"illegal instruction|CUDA_ERROR_(?:ILLEGAL_ADDRESS|LAUNCH_FAILED|MISALIGNED_ADDRESS|"
    r"ILLEGAL_INSTRUCTION)|cudaError(?:IllegalAddress|LaunchFailure|MisalignedAddress)",
    re.IGNORECASE,
)
# Findings that already reproduce a fault: no escalation after them.
_REPRODUCED = ("kernel_error", "hang", "memory")
FAULT_LINE_MAX = 300


def production_fault(meta: Mapping[str, Any]) -> str | None:
    """The GPU fault production died of at this call (one line), or None: the call's process
    did not die of a GPU fault, or this is not the call it died at."""
    crash = meta.get("crash")
    if not isinstance(crash, Mapping):
        return None
    here = crash.get("at_this_call")
    if here is None:  # bundles salvaged before the mark: a call still in flight is where it died
        journal = meta.get("journal")
        here = isinstance(journal, Mapping) and journal.get("in_flight") is True
    if here is not True:
        return None
    for key in ("cuda_error", "exception", "stderr_tail", "traceback"):
        text = crash.get(key)
        if not isinstance(text, str):
            continue
        for line in reversed(text.splitlines()):
            if _FAULT.search(line):
                return line.strip()[:FAULT_LINE_MAX]
    return None


def wants_escalation(findings_kinds: Sequence[str]) -> bool:
    """The plain replay did not reproduce a fault (no crash, hang or memory finding)."""
    return not any(k in _REPRODUCED for k in findings_kinds)


def sanitizer_command(
    bundle: str, call: int, graph: bool, allow: Sequence[str], paths: Sequence[str]
) -> str:
    """The command that runs the escalation on a machine with a GPU and compute-sanitizer."""
    words = ["kdump", "replay", bundle, "--call", str(call), "--mode", "sanitizer"]
    words += ["--tool", "memcheck"] + (["--graph"] if graph else [])
    for a in allow:
        words += ["--allow-target", a]
    for p in paths:
        words += ["--path", p]
    return shlex.join(words)
