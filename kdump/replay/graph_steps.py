"""Names of the graph chain's steps, and the inputs of its changed-addresses step.

Changed addresses: after capture, the kernel runs eagerly on a second copy of the call, every
storage freshly allocated (same shapes, dtypes and strides, so at new addresses) and its
floating-point inputs holding other values (each rotated by part of its length: the same values
at other places; integer arguments such as routing keep theirs, so the call stays within the
kernel's contract). The captured graph is then replayed on its own, unchanged inputs and must
give what the identical replay gave. A library that keeps a descriptor or a workspace from one
call to the next (a TMA tensor map, a pointer table in device memory) makes the graph read the
eager call's buffers: the eager call is right, the replay wrong (or it faults).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kdump.bundle import MaterializedCall
from kdump.bundle.tensors import clone_layout
from kdump.replay.session import Session, poison_outputs

IDENTICAL = "graph/replay identical"
SHRINKING = "graph/replay shrinking batch"  # each replay: "... batch 2 (16 rows per group)"
CHANGED = "graph/replay changed addresses"
CHANGED_EAGER = f"{CHANGED} (eager call)"

# What the baseline of the changed-addresses replay is called in its comparison step
# ("... vs identical replay") and in its finding.
BASELINES = {"identical replay": "the identical replay", "eager": "the eager run"}
STALE_STATE = (
    "the graph read what the eager call at new addresses left behind (a descriptor or workspace "
    "the kernel's library keeps between calls): capture-unsafe"
)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Elsewhere:
    """The second copy of the call: new allocations, other values."""

    mc: MaterializedCall
    bound: dict[str, Any]
    moved: list[str] = field(default_factory=list)  # tensors now at another address
    varied: list[str] = field(default_factory=list)  # tensors now holding other values

    def describe(self) -> str:
        varied = ", ".join(self.varied) if self.varied else "none"
        return (
            f"the kernel ran on new allocations of {len(self.moved)} tensors, with other values "
            f"in {varied}"
        )

    def outputs(self, outputs: dict[str, int]) -> dict[str, torch.Tensor]:
        return {name: clone_layout(self.mc.tensors[idx]) for name, idx in outputs.items()}


def elsewhere(s: Session, here: MaterializedCall, outputs: dict[str, int], seed: int) -> Elsewhere:
    """The call materialised again next to `here` (both alive: every storage at a new address),
    floating-point inputs rotated, outputs poisoned as before any run."""
    other = s.call.materialize(s.device, s.placement())
    taken = {t.data_ptr() for t in here.tensors if t.numel()}
    moved = [
        name
        for name, t in zip(other.tensor_names, other.tensors)
        if t.numel() and t.data_ptr() not in taken
    ]
    varied = [other.tensor_names[i] for i, t in enumerate(other.tensors) if rotate(t, seed)]
    poisoned = poison_outputs(s, other, outputs)  # write-only outputs: as before any run
    varied = [name for name in varied if name not in poisoned]
    return Elsewhere(other, s.spec.bind(other.args, other.kwargs), moved, varied)


def rotate(t: torch.Tensor, seed: int) -> bool:
    """Rotate a floating-point tensor's elements (row-major) by part of its length, in place, as
    raw bits of its width (FP8 and bf16 alike: the same values, elsewhere). True when any element
    changed; a tensor whose elements overlap in memory (stride 0) is left as it is."""
    n = t.numel()
    bits = _INT_OF_SIZE.get(t.element_size())
    if not t.is_floating_point() or bits is None or n < 2:
        return False
    if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        return False
    raw = t.view(bits)
    flat = raw.reshape(-1)
    shift = 1 + (n // 3 + seed) % (n - 1)
    turned = torch.roll(flat, shift)
    changed = bool((turned != flat).any())
    raw.copy_(turned.view(raw.shape))
    return changed
