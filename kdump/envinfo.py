"""The environment manifest a bundle carries: machine, software, GPU, and kernel-library state.

Kernel-library plug-ins provide their process-global settings and which build of the library ran
(KernelPlugin.state, e.g. DeepGEMM's num_sms, tc_util, pdl, mk alignment, block size multiple,
locality-domain calls, JIT settings, and its distribution, version, commit and file: the lines
number their versions independently, so a version alone does not say which code ran; see
docs/deepgemm-lines.md); `register_state_provider` adds others.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

from kdump import config

RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TP_RANK", "DP_RANK")

StateProvider = Callable[[], dict[str, Any] | None]
_PROVIDERS: dict[str, StateProvider] = {}


def register_state_provider(library: str, provider: StateProvider) -> None:
    """Add a function returning a library's global settings (or None when not loaded)."""
    _PROVIDERS[library] = provider


def library_state() -> dict[str, Any]:
    """Global state of every registered library that is loaded; errors are recorded, not raised."""
    from kdump.kernels.registry import library_states

    out: dict[str, Any] = library_states()
    for name, provider in _PROVIDERS.items():
        try:
            state = provider()
        except Exception as exc:  # a provider must never break recording
            state = {"error": f"{type(exc).__name__}: {exc}"}
        if state is not None:
            out[name] = state
    return out


def rank_info(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The rank variables that are set (of `env`, else of the live process environment, read
    on every call: a launcher may set them after kdump started)."""
    found = config.peek_set(RANK_VARS) if env is None else env
    out: dict[str, Any] = {}
    if not found:
        return out
    for var in RANK_VARS:
        value = found.get(var)
        if value is not None:
            try:
                out[var.lower()] = int(value)
            except ValueError:
                out[var.lower()] = value
    return out


def current_rank(env: Mapping[str, str] | None = None) -> int | None:
    info = rank_info(env)
    for key in ("rank", "tp_rank", "local_rank"):
        if isinstance(info.get(key), int):
            return info[key]
    return None


def cuda_initialized() -> bool:
    """Whether this process already has CUDA initialised by torch (asking does not initialise)."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:
        return False


def gpu_info(cuda: bool = True) -> dict[str, Any]:
    """GPU facts. With cuda=False (nothing of the caller's is on a GPU) they are collected only
    if torch has initialised CUDA already: asking the device initialises CUDA, and a process that
    forks workers later breaks with a CUDA context."""
    try:
        import torch
    except ImportError:
        return {"torch": None}
    info: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if not cuda and not cuda_initialized():
        return info  # cuda_available unknown: not asked
    info["cuda_available"] = False
    try:
        if not torch.cuda.is_available():
            return info
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        info.update(
            cuda_available=True,
            device_index=dev,
            device_count=torch.cuda.device_count(),
            gpu_name=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            total_memory=props.total_memory,
        )
        try:
            info["driver_version"] = (
                torch.cuda.driver_version()
                if hasattr(torch.cuda, "driver_version")
                else _driver_version()
            )
        except Exception:
            info["driver_version"] = _driver_version()
    except Exception as exc:  # a broken CUDA setup is a fact worth recording, not a crash
        info["cuda_error"] = f"{type(exc).__name__}: {exc}"
    return info


def _driver_version() -> int | None:
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return v.value
    except OSError:
        pass
    return None


def collect(include_gpu: bool = True, cuda: bool = False) -> dict[str, Any]:
    """The environment manifest (docs/FORMAT.md, "env"). GPU facts need include_gpu, and a call
    with CUDA tensors (`cuda`) or CUDA already initialised (see gpu_info)."""
    env = {
        **_process_facts(),
        "argv": list(sys.argv)[:32],
        "ranks": rank_info(),
        "env_vars": config.recorded_environment(),
    }
    if include_gpu:
        env.update(gpu_info(cuda=cuda))
    env["libraries"] = library_state()
    return env


_FACTS: tuple[int, dict[str, Any]] | None = None


def _process_facts() -> dict[str, Any]:
    """Facts fixed for the life of a process (platform.platform() alone reads the interpreter
    binary): collected once per pid, so a forked child reports its own pid."""
    global _FACTS
    pid = os.getpid()
    if _FACTS is None or _FACTS[0] != pid:
        facts = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "hostname": socket.gethostname(),
            "pid": pid,
            "kdump": _kdump_version(),
        }
        _FACTS = (pid, facts)
    return dict(_FACTS[1])


def _kdump_version() -> str:
    from kdump._version import __version__

    return __version__
