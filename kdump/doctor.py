"""`kdump doctor`: what this machine can replay, and how to fix what it cannot."""

from __future__ import annotations

import platform
import sys
from typing import Any

from kdump import __version__
from kdump.tools import find_tool, tool_version


def _check(name: str, ok: bool, detail: str, fix: str = "") -> dict[str, Any]:
    return {"name": name, "ok": ok, "detail": detail, "fix": fix}


def diagnose() -> dict[str, Any]:
    checks = [
        _check(
            "kdump",
            True,
            f"{__version__} on Python {sys.version.split()[0]}, {platform.platform()}",
        )
    ]
    try:
        import torch
    except ImportError:
        checks.append(_check("torch", False, "not installed", "pip install torch"))
        return {"checks": checks}
    checks.append(_check("torch", True, f"{torch.__version__} (CUDA {torch.version.cuda})"))
    gpu = torch.cuda.is_available()
    if gpu:
        from kdump.envinfo import gpu_info

        g = gpu_info()
        checks.append(
            _check(
                "gpu",
                True,
                f"{g.get('gpu_name')} cc {g.get('compute_capability')}, "
                f"{g.get('sm_count')} SMs, driver {g.get('driver_version')}",
            )
        )
    else:
        checks.append(
            _check(
                "gpu",
                False,
                "no CUDA GPU visible",
                "replays run on the CPU with --backend reference; GPU backends need "
                "a CUDA GPU and a CUDA build of torch",
            )
        )
    checks.append(_check("backend reference", True, "torch reference (CPU and GPU)"))
    from kdump.kernels.registry import plugins

    for plugin in plugins():
        try:
            lines = plugin.checks(gpu)
        except Exception as exc:  # a broken plug-in is one failed line, not a crashed doctor
            lines = [_check(f"plug-in {plugin.name}", False, f"{type(exc).__name__}: {exc}")]
        checks.extend(lines)
    san = find_tool("compute-sanitizer")
    if san:
        checks.append(_check("compute-sanitizer", True, f"{san} ({tool_version(san) or '?'})"))
    else:
        checks.append(
            _check(
                "compute-sanitizer",
                False,
                "not found",
                "install the CUDA toolkit, pip install nvidia-cuda-sanitizer-api, or "
                "set KDUMP_SANITIZER=/path/to/compute-sanitizer",
            )
        )
    return {"checks": checks}


# What `kdump doctor --selftest` replays on the packaged kernel: every routing layout it has,
# both scale formats, empty groups, and a psum layout with enough groups that its group lookup
# works in chunks (kdump.kernels.sm120: 40 groups, chunks of two ends).
_CONTIGUOUS = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
_MASKED = "deep_gemm:m_grouped_fp8_gemm_nt_masked"
SELFTEST_CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("labels ue8m0", _CONTIGUOUS, dict(num_groups=8, n=512, k=1024, expected_m=96)),
    (
        "labels fp32",
        _CONTIGUOUS,
        dict(num_groups=8, n=512, k=1024, expected_m=96, scale_format="fp32"),
    ),
    (
        "psum ue8m0",
        _CONTIGUOUS,
        dict(num_groups=40, n=256, k=512, expected_m=40, empty_groups=8, use_psum_layout=True),
    ),
    (
        "masked fp32",
        _MASKED,
        dict(num_groups=6, n=256, k=640, expected_m=70, empty_groups=1, scale_format="fp32"),
    ),
)


def selftest_bundles(directory: Any, device: str) -> list[tuple[str, Any]]:
    """Write one bundle per SELFTEST_CASES entry into `directory`: [(label, path)]."""
    from pathlib import Path

    from kdump.bundle import capture_call, save_calls
    from kdump.kernels.registry import spec_for

    out = []
    for label, spec_id, shape in SELFTEST_CASES:
        spec = spec_for(spec_id)
        args, kwargs = spec.generate(seed=1, device=device, **shape)
        path = Path(directory, f"selftest_{label.replace(' ', '_')}.kdump")
        save_calls(path, [capture_call(spec.id, args, kwargs, names=spec.param_names())])
        out.append((label, path))
    return out


def run_selftest() -> dict[str, Any]:
    """Replay SELFTEST_CASES on the packaged kernel of this GPU against the reference."""
    import tempfile

    import torch

    from kdump.errors import worst_exit_code

    if not torch.cuda.is_available():
        return {"exit_code": 125, "summary": "no CUDA GPU: nothing to test", "verdicts": []}
    from kdump.replay import replay

    verdicts, parts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in selftest_bundles(tmp, "cuda"):
            for v in replay([path], backend="packaged", device="cuda", repeat=2):
                verdicts.append(v)
                parts.append(f"{label}: {v.headline()}")
    code = worst_exit_code([v.exit_code for v in verdicts])
    return {
        "exit_code": code,
        "summary": "; ".join(parts),
        "verdicts": [v.to_json() for v in verdicts],
    }
