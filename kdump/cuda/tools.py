"""Finding external tools: compute-sanitizer, cuobjdump/nvdisasm (pip wheels or a CUDA install)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from kdump import config


def _nvidia_wheel_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def find_tool(name: str) -> Path | None:
    """A CUDA tool by name: KDUMP_SANITIZER (for compute-sanitizer), CUDA_HOME, PATH,
    /usr/local/cuda, then pip's nvidia wheels."""
    if name == "compute-sanitizer":
        explicit = config.get("KDUMP_SANITIZER")
        if explicit:
            p = Path(explicit)
            return p if p.is_file() else None
    candidates: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = config.get(var)
        if home:
            candidates += [Path(home, "bin", name), Path(home, "compute-sanitizer", name)]
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    candidates += [
        Path("/usr/local/cuda/bin", name),
        Path("/usr/local/cuda/compute-sanitizer", name),
    ]
    for base in _nvidia_wheel_dirs():
        candidates += [
            base / "cu13" / "bin" / name,
            base / "cu13" / "compute-sanitizer" / name,
            base / "cuda_sanitizer_api" / "compute-sanitizer" / name,
        ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    return None


def tool_version(path: Path) -> str | None:
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"(\d{4}\.\d+\.\d+|\d+\.\d+\.\d+)", out.stdout + out.stderr)
    return m.group(1) if m else None
