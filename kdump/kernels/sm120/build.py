"""Run-time build of grouped_gemm.cu with NVRTC (through cuda.core), with an on-disk cubin cache.

Nothing here needs a GPU: CI compiles for sm_90a and sm_120a to check the source. The cache key is
the sha256 of the source, the target arch, the NVRTC version, every compile option and the tile
configuration, so a stale cubin can never be picked up. Cache writes are atomic (temporary file +
os.replace) so several processes may compile the same kernel at once.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

from kdump import config
from kdump.cuda.nvrtc import ToolchainError, nvrtc_version
from kdump.errors import InternalError

from .configs import TileConfig

SOURCE_NAME = "grouped_gemm.cu"
CACHE_ENV_VAR = "KDUMP_CACHE_DIR"

# Kernels compiled into every cubin (extern "C" names in grouped_gemm.cu).
KERNEL_NAMES: tuple[str, ...] = (
    "kd_gemm_labels_fp32",
    "kd_gemm_labels_ue8m0",
    "kd_gemm_psum_fp32",
    "kd_gemm_psum_ue8m0",
    "kd_gemm_masked_fp32",
    "kd_gemm_masked_ue8m0",
    "kd_gemm_labels_fp32_stale",
    "kd_gemm_labels_ue8m0_stale",
    "kd_plan_stale_schedule",
)


# The packaged kernel's prerequisites fail like every kdump kernel's (kdump.cuda.nvrtc).
PackagedKernelError = ToolchainError


class PackagedSourceError(InternalError):
    """kdump's own CUDA source does not compile: a bug in kdump, not in this machine."""


def cache_dir() -> Path:
    """Where cubins are cached: $KDUMP_CACHE_DIR/sm120, default ~/.cache/kdump/sm120."""
    root = config.get(CACHE_ENV_VAR) or str(Path.home() / ".cache" / "kdump")
    return Path(root).expanduser() / "sm120"


def kernel_source() -> str:
    return importlib.resources.files(__package__).joinpath(SOURCE_NAME).read_text(encoding="utf-8")


def cutlass_include_dir() -> Path:
    """CUTLASS/CuTe headers of the nvidia-cutlass wheel, located without importing the package
    (its Python side pulls scipy and networkx)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise PackagedKernelError(
            "CUTLASS headers not found: install the nvidia-cutlass wheel "
            "(pip install nvidia-cutlass==4.2.0.0)"
        )
    for loc in spec.submodule_search_locations:
        inc = Path(loc) / "source" / "include"
        if (inc / "cute" / "tensor.hpp").is_file():
            return inc
    raise PackagedKernelError(
        f"the nvidia-cutlass wheel at {list(spec.submodule_search_locations)} has no "
        "source/include/cute headers; reinstall nvidia-cutlass==4.2.0.0"
    )


def cuda_include_dir() -> Path:
    """CUDA runtime headers (cuda_bf16.h and cccl/): pip's nvidia/cu13/include, else CUDA_HOME."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates += [Path(loc) / "cu13" / "include", Path(loc) / "cuda_runtime" / "include"]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = config.get(var)
        if root:
            candidates.append(Path(root) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for inc in candidates:
        if (inc / "cuda_bf16.h").is_file() and (inc / "cccl" / "cuda" / "std").is_dir():
            return inc
    raise PackagedKernelError(
        "CUDA headers not found (need cuda_bf16.h and cccl/): install nvidia-cuda-runtime and "
        "nvidia-cuda-cccl (pip) or set CUDA_HOME to a CUDA 12.8+ toolkit"
    )


@dataclass(frozen=True)
class BuildRequest:
    arch: str  # e.g. "sm_90a", "sm_120a"
    config: TileConfig

    def options_summary(self) -> list[str]:
        return [f"arch={self.arch}", "std=c++17", "lineinfo", "dev-default", *self.config.defines()]


def _program_options(req: BuildRequest):  # -> cuda.core.ProgramOptions
    from cuda.core import ProgramOptions

    return ProgramOptions(
        name=SOURCE_NAME,
        arch=req.arch,
        std="c++17",
        lineinfo=True,  # always: sanitizer and fault reports then name source lines
        device_as_default_execution_space=True,  # CUTLASS's unannotated constexpr helpers
        include_path=[
            str(cutlass_include_dir()),
            str(cuda_include_dir()),
            str(cuda_include_dir() / "cccl"),
        ],
        define_macro=req.config.defines(),
    )


def cache_key(source: str, req: BuildRequest) -> str:
    h = hashlib.sha256()
    h.update(source.encode())
    h.update(repr((req.options_summary(), nvrtc_version())).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class BuildResult:
    cubin: bytes
    path: Path
    from_cache: bool
    seconds: float
    log: str


def build_cubin(req: BuildRequest, use_cache: bool = True) -> BuildResult:
    """Compile (or fetch from the cache) the cubin for one arch and tile configuration."""
    try:
        from cuda.core import Program
    except ImportError as exc:
        raise PackagedKernelError(
            f"cuda-core is not installed ({exc}): pip install cuda-core"
        ) from exc
    req.config.check()
    source = kernel_source()
    path = cache_dir() / f"grouped_gemm-{req.arch}-{cache_key(source, req)[:32]}.cubin"
    if use_cache and path.is_file():
        return BuildResult(path.read_bytes(), path, True, 0.0, "")
    opts = _program_options(req)
    t0 = time.perf_counter()
    try:
        obj = Program(source, "c++", opts).compile("cubin", logs=None)
    except Exception as exc:
        first = str(exc).strip().splitlines()
        raise PackagedSourceError(
            f"NVRTC failed to compile kdump's {SOURCE_NAME} for {req.arch} (a kdump bug; report "
            "it with this line): "
            f"{' | '.join(first[:6]) if first else type(exc).__name__}"
        ) from exc
    seconds = time.perf_counter() - t0
    cubin = bytes(obj.code)
    if use_cache:
        _atomic_write(path, cubin)
    return BuildResult(cubin, path, False, seconds, "")


def _atomic_write(path: Path, data: bytes) -> None:
    from kdump.bundle.store import atomic_write

    try:
        atomic_write(path, data)
    except OSError:
        # A read-only or full cache directory only costs a recompile next time.
        return
