"""Recorded Triton launches replayed compiled on a GPU, judged by the recording and by Triton's
interpreter running the same launch in a process of its own ("vs interpreter"): a plain kernel
agrees with both, a changed kernel is named in one line and exits 1, and an fp32 `tl.dot`
(TF32 on the GPU, full fp32 in the interpreter) agrees within the interpreter tolerance.

Bundles are made from real compiled launches on the GPU, captured as the recorder captures a
launch (the kernel's parameters and constexprs as arguments, the launch record, the outputs)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import attach_outputs, capture_call, load_bundle, save_calls
from kdump.bundle.capture import input_tensors
from kdump.kernels.triton import launch as tl_launch
from kdump.replay import ReplayOptions, replay

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

MODULE = "kd_triton_gpu_kernels"
KDUMP = [sys.executable, "-m", "kdump"]
KDUMP_ROOT = str(Path(kdump.__file__).resolve().parent.parent)

SOURCE = """
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * {factor}, mask=mask)


@triton.jit
def dot_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    # C = A @ B for row-major fp32 matrices; tl.dot on fp32 uses TF32 on the GPU by default
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :],
                    mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :],
                    mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
"""
SCALE_T, DOT_T = f"{MODULE}:scale_kernel", f"{MODULE}:dot_kernel"


def _folder(root: Path, name: str, factor: int) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE.format(factor=factor)))
    return folder


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    folders = {"good": _folder(tmp_path, "good", 2), "changed": _folder(tmp_path, "changed", 3)}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compiled kernels here
    monkeypatch.setenv("KDUMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.syspath_prepend(str(folders["good"]))
    sys.modules.pop(MODULE, None)
    yield folders
    sys.modules.pop(MODULE, None)


def _save(path: Path, name: str, args: list, kwargs: dict, grid: tuple, outputs: list[int]) -> Path:
    """Launch `name` compiled on the GPU and save the launch as a recorder does."""
    kernel = getattr(importlib.import_module(MODULE), name)
    call = capture_call(f"{MODULE}:{name}", args, kwargs, names=list(tl_launch.param_names(kernel)))
    call.launch = tl_launch.launch_record(kernel, grid, {"num_warps": 4})
    tl_launch.launch_again(kernel, call.launch, args, kwargs)
    torch.cuda.synchronize()
    attach_outputs(call, input_tensors(call, args, kwargs), outputs)
    return save_calls(path, [call])


def _scale(path: Path) -> Path:
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1000, device="cuda", generator=g)
    out = torch.zeros(1000, device="cuda")
    return _save(path, "scale_kernel", [x, out, 1000], {"BLOCK": 256}, (4,), [1])


def _dot(path: Path) -> Path:
    g = torch.Generator(device="cuda").manual_seed(4)
    m, n, k = 96, 80, 128
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(k, n, device="cuda", generator=g)
    c = torch.zeros(m, n, device="cuda")
    kw = {"BM": 32, "BN": 32, "BK": 32}
    return _save(path, "dot_kernel", [a, b, c, m, n, k], kw, (3, 3), [2])


def _steps(v) -> dict[str, object]:
    return {s.name: s for s in v.steps}


def test_a_compiled_launch_agrees_with_the_recording_and_the_interpreter(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    bundle = _scale(tmp_path / "a.kdump")
    opts = ReplayOptions(allow_targets=(SCALE_T,), paths=(str(kernels["good"]),))
    (v,) = replay([bundle], opts)
    assert v.device.startswith("cuda") and v.exit_code == 0, v.to_json()
    steps = _steps(v)
    assert steps["eager/run 1 vs recorded"].status == "ok"
    assert "bit-identical" in steps["eager/run 1 vs recorded"].message
    oracle = steps["eager/run 1 vs interpreter"]
    assert oracle.status == "ok" and "matches Triton's interpreter" in oracle.message
    assert not any(n.startswith("no interpreter oracle") for n in v.notes)
    # The interpreter's result is cached: a second replay does not run it again.
    (again,) = replay([bundle], opts)
    assert "(cached)" in _steps(again)["eager/run 1 vs interpreter"].message


def test_a_changed_kernel_fails_against_the_recording_in_one_line(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    bundle = _scale(tmp_path / "a.kdump")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env["PYTHONPATH"] = os.pathsep.join([KDUMP_ROOT, env.get("PYTHONPATH", "")])
    cmd = [*KDUMP, "replay", str(bundle), "--allow-target", SCALE_T, "--json"]
    got = subprocess.run(
        [*cmd, "--path", str(kernels["changed"])],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert got.returncode == 1, got.stdout + got.stderr
    (v,) = json.loads(got.stdout)["verdicts"]
    notes = [n for n in v["notes"] if "kernel source changed since the recording" in n]
    assert len(notes) == 1
    assert any(f["details"].get("oracle") == "recorded" for f in v["findings"])
    # The interpreter runs the same (changed) installed kernel: it agrees with the compiled run.
    oracle = [s for s in v["steps"] if s["name"] == "eager/run 1 vs interpreter"]
    assert oracle and oracle[0]["status"] == "ok"


def test_an_fp32_dot_agrees_with_the_interpreter_within_the_tf32_tolerance(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    bundle = _dot(tmp_path / "d.kdump")
    assert load_bundle(bundle).call(0).launch.grid == (3, 3)
    opts = ReplayOptions(allow_targets=(DOT_T,), paths=(str(kernels["good"]),))
    (v,) = replay([bundle], opts)
    assert v.exit_code == 0, v.to_json()
    steps = _steps(v)
    assert steps["eager/run 1 vs recorded"].status == "ok"
    oracle = steps["eager/run 1 vs interpreter"]
    assert oracle.status == "ok", oracle


def test_a_compiled_launch_replays_in_graph_mode(kernels: dict[str, Path], tmp_path: Path) -> None:
    bundle = _scale(tmp_path / "a.kdump")
    opts = ReplayOptions(mode="graph", allow_targets=(SCALE_T,), paths=(str(kernels["good"]),))
    (v,) = replay([bundle], opts)
    assert v.exit_code == 0, v.to_json()
    assert any(s.name.startswith("graph/replay") and s.status == "ok" for s in v.steps)
