"""A recorded Triton launch in a replay process: the installed kernel it launches, how it runs
here (compiled on a GPU, or in Triton's interpreter on the CPU) and whether that is the way the
recording ran (which decides between bitwise and tolerant comparison)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kdump.bundle import Call
from kdump.kernels import registry
from kdump.kernels.triton import replay as triton_replay


def prepare_kernel(
    call: Call, device: torch.device, allowed: Sequence[str], note: Callable[[str], None]
) -> Any:
    """For a recorded Triton launch, the installed kernel (resolved under the trust rule the
    replay admitted the target by; CannotRunError when it is no Triton kernel or cannot run on
    `device`), with a note for each way it differs from the recorded one; else None. On the CPU
    the kernel runs in Triton's interpreter, asked for before its module is imported."""
    launch = call.launch
    if not triton_replay.is_triton_launch(launch):
        return None
    assert launch is not None
    if device.type == "cpu":
        triton_replay.want_interpreter()
    found = registry.resolve_allowed(call.target, allowed)
    kernel = triton_replay.kernel_for(call.target, found, device.type)
    if device.type == "cpu":
        note("no GPU used: the Triton kernel runs in Triton's interpreter (CPU, numpy)")
    for text in triton_replay.differences(kernel, launch):
        note(text)
    return kernel


def recorded_device_type(call: Call) -> str:
    """'cuda' when the call's tensors lived on a GPU at the recording, else 'cpu'."""
    ran_on = call.meta.get("device")
    if isinstance(ran_on, str) and ran_on.startswith("cuda"):
        return "cuda"
    return "cuda" if any(st.device.startswith("cuda") for st in call.storages) else "cpu"


def same_setup(call: Call, kernel: Any, device: torch.device) -> bool:
    """A Triton launch gives the recorded bits again only from the same source, the same
    Triton and the same way of running it (compiled on a GPU, or interpreted on the CPU)."""
    launch = call.launch
    assert launch is not None
    return (
        recorded_device_type(call) == device.type
        and triton_replay.installed_version() == launch.version
        and not triton_replay.differences(kernel, launch)
    )


def other_engine(call: Call, kernel: Any, device: torch.device) -> bool:
    """Whether the replay runs the kernel the other way than the recording did (interpreted
    against compiled, or the other way round): then the interpreter tolerance applies."""
    return kernel is not None and recorded_device_type(call) != device.type
