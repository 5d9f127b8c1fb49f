"""`kdump doctor`: what this machine can replay, and how to fix what it cannot."""

from __future__ import annotations

import platform
import re
import shlex
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from kdump._version import __version__
from kdump.cuda.tools import find_tool, tool_version


def _check(name: str, ok: bool, detail: str, fix: str = "") -> dict[str, Any]:
    return {"name": name, "ok": ok, "detail": detail, "fix": fix}


_GPU_ACTION = (
    "run on a machine with an NVIDIA GPU and a CUDA build of torch "
    "(https://pytorch.org/get-started/locally/), or replay on the CPU with --backend reference"
)
# A plug-in's fix that only restates a cause -> what to do about it.
_ACTIONS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"no CUDA (device|GPU)|needs a CUDA GPU|CUDA is not available", re.I), _GPU_ACTION),
    (
        re.compile(r"NVRTC|CUTLASS|cuda[.-]core|cuda[.-]bindings", re.I),
        "pip install 'kdump-gpu[kernel]'",
    ),
    (re.compile(r"^torch is not installed", re.I), "pip install torch"),
)


def _closed(text: str) -> str:
    """`text` with the parentheses a cut message left open closed again."""
    depth = 0
    for c in text:
        depth += {"(": 1, ")": -1}.get(c, 0)
    return text + ")" * max(depth, 0)


def _action(line: dict[str, Any]) -> str:
    """The line's fix as an action: a fix that repeats the problem (or only names a cause)
    becomes what to do about it."""
    fix, detail = str(line.get("fix") or ""), str(line.get("detail") or "")
    restates = fix.strip().lower() == detail.strip().lower() or fix.lower().startswith("needs ")
    if fix and not restates:
        return fix
    for pattern, action in _ACTIONS:
        if pattern.search(fix) or pattern.search(detail):
            return action
    return fix if fix and fix.strip().lower() != detail.strip().lower() else ""


def tidy(line: dict[str, Any]) -> dict[str, Any]:
    """A doctor line as printed: its detail whole, its fix an action (plug-ins write the lines;
    this is the one place that holds them to that)."""
    out = dict(line)
    out["detail"] = _closed(str(line.get("detail", "")))
    out["fix"] = "" if line.get("ok") else _action(line)
    return out


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
        checks.append(_check("gpu", False, "no CUDA GPU visible", _GPU_ACTION))
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
    return {"checks": [tidy(c) for c in checks]}


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


# --- how to replay a bundle here: the commands kdump prints --------------------------------------

# module:qualname made of Python identifiers: the only targets a printed command names.
_PLAIN_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.A)


def importable_at_replay(module: str, paths: Sequence[str] = ()) -> bool:
    """Whether a replay started here (with `--path paths`) finds `module`
    (kdump.replay.child.module_origin: the replay child's environment, the top-level package
    only)."""
    top = module.split(".")[0]
    if not top or top == "torch":
        return True
    from kdump.replay.child import module_origin

    return module_origin(top, paths) is not None


def unclaimed_targets(targets: Iterable[str]) -> list[str]:
    """The targets (in order, once each) that no kernel plug-in claims: replay runs them only
    when the user allows them, and imports their module from the environment or --path."""
    from kdump.kernels.registry import claiming_plugin

    out: list[str] = []
    for t in targets:
        if t not in out and claiming_plugin(t) is None:
            out.append(t)
    return out


def replay_words(
    targets: Iterable[str],
    allow_flag: str = "--allow-target",
    path_flag: str = "--path",
    paths: Sequence[str] = (),
) -> tuple[list[str], list[str]]:
    """What a replay of a bundle with `targets` needs on its command line to run here as printed:
    (words: `--allow-target T` per target no plug-in claims whose name is a plain
    module:qualname, and `--path P` per folder given; modules: the modules of those targets
    that a replay would still not find, for a hint)."""
    words: list[str] = []
    missing: list[str] = []
    for t in unclaimed_targets(targets):
        if not _PLAIN_TARGET.fullmatch(t):
            continue  # not a name a user would allow: the replay's own refusal explains it
        words += [allow_flag, t]
        module = t.partition(":")[0]
        if not importable_at_replay(module, paths):  # torch.ops namespaces always are
            missing.append(module)
    for p in paths:
        words += [path_flag, p]
    return words, missing


def path_hint(modules: Sequence[str], path_flag: str = "--path") -> str:
    """The hint for target modules a replay would not find here."""
    shown = ", ".join(dict.fromkeys(modules))
    return (
        f"{shown} cannot be imported here: add {path_flag} DIR with the folder that holds it "
        "(or install it)"
    )


def quoted(words: Iterable[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)
