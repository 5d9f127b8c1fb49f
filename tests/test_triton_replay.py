"""Replaying recorded Triton launches on the CPU, where the kernel runs in Triton's interpreter:
a recording replays clean, a changed kernel is named in one line and mismatches (exit 1), a
target that is no Triton kernel cannot run (exit 125), an unmasked read past an input is named
by the halo differential; and the interpreter oracle's pieces (its own process, its cache, its
time budget, a kernel it cannot run) work.

Bundles are made from real launches of real `@triton.jit` kernels under TRITON_INTERPRET=1: the
call is captured as the recorder captures a launch (the kernel's parameters and constexprs as
arguments, the launch record, the outputs after the launch)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kdump
from kdump.bundle import attach_outputs, capture_call, load_bundle, save_calls
from kdump.bundle.capture import input_tensors
from kdump.bundle.tensors import clone_layout
from kdump.kernels.registry import check_target
from kdump.kernels.triton import launch as tl_launch
from kdump.replay import ReplayOptions, replay
from kdump.replay.session import Request, Session, runs_interpreted

pytest.importorskip("triton")

MODULE = "kd_triton_kernels"
KDUMP = [sys.executable, "-m", "kdump"]
KDUMP_ROOT = str(Path(kdump.__file__).resolve().parent.parent)

HEADER = """
import triton
import triton.language as tl
"""
SCALE = """

@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * {factor}, mask=mask)
"""
PAIR_SUM = """

@triton.jit
def pair_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # out[i] = x[i] + x[i + 1]: the last element reads one past the end of x
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(x_ptr + offs, mask=mask)
    b = tl.load(x_ptr + offs + 1, mask=mask)
    tl.store(out_ptr + offs, a + b, mask=mask)
"""
# The same name, no longer a Triton kernel.
NOT_A_KERNEL = """

def scale_kernel(x_ptr, out_ptr, n, BLOCK=64):
    out_ptr.copy_(x_ptr * 2)
"""
# The same name, with inline assembly: Triton's interpreter cannot run it.
INLINE_ASM = """

@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.inline_asm_elementwise(
        "mul.f32 $0, $1, 0f40000000;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
    )
    tl.store(out_ptr + offs, y, mask=mask)
"""

SCALE_T = f"{MODULE}:scale_kernel"
PAIR_T = f"{MODULE}:pair_sum_kernel"


def _folder(root: Path, name: str, body: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(HEADER + body))
    return folder


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    """Module folders: the recorded kernels, a changed one, a non-kernel, an inline-asm one.
    The recorded module is imported here under the interpreter; the cache goes to tmp_path."""
    folders = {
        "good": _folder(tmp_path, "good", SCALE.format(factor=2) + PAIR_SUM),
        "changed": _folder(tmp_path, "changed", SCALE.format(factor=3) + PAIR_SUM),
        "not_kernel": _folder(tmp_path, "not_kernel", NOT_A_KERNEL),
        "asm": _folder(tmp_path, "asm", INLINE_ASM),
    }
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KDUMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.syspath_prepend(str(folders["good"]))
    sys.modules.pop(MODULE, None)
    yield folders
    sys.modules.pop(MODULE, None)


def _record(
    path: Path,
    name: str,
    n: int = 100,
    block: int = 64,
    meta: dict[str, Any] | None = None,
    perturb: float = 0.0,
) -> Path:
    """Launch `name` of the recorded module on fresh inputs and save the launch as a recorder
    does: arguments before, launch record, outputs after (`perturb` shifts the recorded
    output relatively, as another GPU's rounding would)."""
    mod = importlib.import_module(MODULE)
    kernel = getattr(mod, name)
    g = torch.Generator().manual_seed(3)
    x, out = torch.randn(n, generator=g), torch.zeros(n)
    args, kwargs = [x, out, n], {"BLOCK": block}
    grid = tl_launch.evaluate_grid(lambda m: ((m["n"] + m["BLOCK"] - 1) // m["BLOCK"],),
                                   kernel, args, kwargs)  # fmt: skip
    call = capture_call(
        f"{MODULE}:{name}", args, kwargs, names=list(tl_launch.param_names(kernel)), meta=meta
    )
    call.launch = tl_launch.launch_record(kernel, grid, {})
    tl_launch.launch_again(kernel, call.launch, args, kwargs)
    if perturb:
        out.mul_(1 + perturb)
    attach_outputs(call, input_tensors(call, args, kwargs), [1])
    return save_calls(path, [call])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDUMP_", "TRITON_"))}
    env["PYTHONPATH"] = os.pathsep.join([KDUMP_ROOT, env.get("PYTHONPATH", "")])
    return env


def _cli(bundle: Path, target: str, folder: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [*KDUMP, "replay", str(bundle), "--allow-target", target, "--path", str(folder)]
    return subprocess.run(
        [*cmd, *extra], capture_output=True, text=True, env=_env(), cwd=folder.parent, timeout=600
    )


def test_a_recorded_launch_replays_in_the_interpreter_on_the_cpu(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    bundle = _record(tmp_path / "a.kdump", "scale_kernel")
    assert load_bundle(bundle).call(0).launch is not None
    assert runs_interpreted(load_bundle(bundle).call(0), "cpu")
    opts = ReplayOptions(allow_targets=(SCALE_T,), paths=(str(kernels["good"]),), device="cpu")
    (v,) = replay([bundle], opts)
    assert v.exit_code == 0 and v.outcome == "clean", v.to_json()
    assert v.device == "cpu" and v.backend == "library"
    assert any("runs in Triton's interpreter" in n for n in v.notes)
    assert not any("source changed" in n for n in v.notes)
    compared = {s.name: s for s in v.steps if " vs " in s.name}
    assert compared["eager/run 1 vs recorded"].status == "ok"
    assert "bit-identical" in compared["eager/run 1 vs recorded"].message
    assert not any("vs interpreter" in name for name in compared)  # it is the replay here


def test_a_changed_kernel_is_named_in_one_line_and_exits_1(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    bundle = _record(tmp_path / "a.kdump", "scale_kernel")
    got = _cli(bundle, SCALE_T, kernels["changed"], "--json")
    assert got.returncode == 1, got.stderr
    (v,) = json.loads(got.stdout)["verdicts"]
    changed = [n for n in v["notes"] if "kernel source changed since the recording" in n]
    assert len(changed) == 1, v["notes"]
    recorded = load_bundle(bundle).call(0).launch.source_sha256
    assert f"sha256 {recorded[:4]}… recorded" in changed[0]
    assert any(f["kind"] == "mismatch" and f["details"]["oracle"] == "recorded"
               for f in v["findings"])  # fmt: skip
    # The table says it once too.
    table = _cli(bundle, SCALE_T, kernels["changed"])
    assert table.returncode == 1
    assert table.stdout.count("kernel source changed since the recording") == 1


def test_the_unchanged_kernel_on_path_reproduces(kernels: dict[str, Path], tmp_path: Path) -> None:
    bundle = _record(tmp_path / "a.kdump", "scale_kernel")
    got = _cli(bundle, SCALE_T, kernels["good"])
    assert got.returncode == 0, got.stdout + got.stderr
    assert "source changed" not in got.stdout


def test_a_target_that_is_no_triton_kernel_cannot_run(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    bundle = _record(tmp_path / "a.kdump", "scale_kernel")
    got = _cli(bundle, SCALE_T, kernels["not_kernel"], "--json")
    assert got.returncode == 125, got.stdout + got.stderr
    (v,) = json.loads(got.stdout)["verdicts"]
    (f,) = v["findings"]
    assert f["kind"] == "cannot_run"
    assert "not a Triton kernel" in f["message"] and "\n" not in f["message"]


def test_a_read_past_the_input_is_named_by_the_halo_differential(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    bundle = _record(tmp_path / "b.kdump", "pair_sum_kernel")
    opts = ReplayOptions(allow_targets=(PAIR_T,), paths=(str(kernels["good"]),), device="cpu")
    (v,) = replay([bundle], opts)
    memory = [f for f in v.findings if f.kind == "memory"]
    assert memory, v.to_json()
    assert "reads past the end of x_ptr" in memory[0].message
    assert "out_ptr[99:100]" in memory[0].message
    assert v.exit_code == 4


def test_a_recording_of_the_compiled_kernel_is_judged_with_the_interpreter_tolerance(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    """Recorded compiled on a GPU (meta device), replayed in the interpreter: rounding-sized
    differences pass; recorded in the interpreter, the same difference is a mismatch."""
    gpu = _record(tmp_path / "g.kdump", "scale_kernel", meta={"device": "cuda:0"}, perturb=1e-4)
    cpu = _record(tmp_path / "c.kdump", "scale_kernel", perturb=1e-4)
    opts = ReplayOptions(allow_targets=(SCALE_T,), paths=(str(kernels["good"]),), device="cpu")
    v_gpu, v_cpu = replay([gpu, cpu], opts)
    assert v_gpu.exit_code == 0, v_gpu.to_json()
    step = next(s for s in v_gpu.steps if s.name == "eager/run 1 vs recorded")
    assert "within tolerance" in step.message and "setup differs" in step.message
    assert v_cpu.exit_code == 1, v_cpu.to_json()


# --- the interpreter oracle's pieces ------------------------------------------------------------


def _session(bundle: Path, folder: Path, target: str = SCALE_T) -> Session:
    """A replay session in this process (on the CPU: the module is imported interpreted)."""
    check_target(target, (target,))
    opts = ReplayOptions(allow_targets=(target,), paths=(str(folder),), device="cpu")
    return Session(Request(str(bundle), 0, opts), lambda kind, payload: None)


def _run(s: Session) -> dict[str, torch.Tensor]:
    from kdump.replay.session import poison_outputs

    mc = s.materialize()
    poison_outputs(s, mc, {"out_ptr": 1})
    s.backend.resolve(s.spec, s.call.target)(*mc.args, **mc.kwargs)
    return {"out_ptr": clone_layout(mc.tensors[1])}


def test_the_interpreter_oracle_runs_in_its_own_process_once_per_input(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    from kdump.replay import triton_oracle

    bundle = _record(tmp_path / "a.kdump", "scale_kernel")
    s = _session(bundle, kernels["good"])
    actual = _run(s)
    triton_oracle.check(s, "eager/run 1", {"out_ptr": 1}, [], actual)
    first = s.verdict.steps[-1]
    assert first.name == "eager/run 1 vs interpreter" and first.status == "ok", first
    assert "matches Triton's interpreter" in first.message and "cached" not in first.message
    cached = list(triton_oracle.cache_dir().glob("*.kdump"))
    assert len(cached) == 1 and cached[0].parent == tmp_path / "cache" / "triton-interpreter"
    # The same input again: the cached result, no process.
    triton_oracle.check(s, "eager/run 1", {"out_ptr": 1}, [], actual)
    assert "(cached)" in s.verdict.steps[-1].message
    assert s.verdict.steps[-1].status == "ok"
    # A wrong compiled result is a mismatch against the interpreter.
    wrong = {"out_ptr": actual["out_ptr"] * 1.5}
    triton_oracle.check(s, "eager/run 1", {"out_ptr": 1}, [], wrong)
    assert s.verdict.steps[-1].status == "fail"
    (f,) = s.verdict.findings
    assert f.kind == "mismatch" and f.details["oracle"] == "interpreter"
    assert "differs from Triton's interpreter" in f.message
    assert len(list(triton_oracle.cache_dir().glob("*.kdump"))) == 1


def test_the_interpreter_oracle_keys_its_cache_by_the_inputs(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    from kdump.replay import triton_oracle

    a = _session(_record(tmp_path / "a.kdump", "scale_kernel"), kernels["good"])
    b = _session(_record(tmp_path / "b.kdump", "scale_kernel", n=90), kernels["good"])
    same = _session(_record(tmp_path / "c.kdump", "scale_kernel"), kernels["good"])
    keys = [
        triton_oracle.cache_key(s, triton_oracle.job_for(s, {"out_ptr": 1}, [], tmp_path / "o"))
        for s in (a, b, same)
    ]
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_a_kernel_past_the_budget_has_no_interpreter_oracle(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    from kdump.replay import triton_oracle

    s = _session(_record(tmp_path / "a.kdump", "scale_kernel"), kernels["good"])
    triton_oracle.check(s, "eager/run 1", {"out_ptr": 1}, [], _run(s), budget=0.2)
    assert "no interpreter oracle: ran past the 0.2 s budget" in s.verdict.notes
    assert not s.verdict.findings
    assert not any("vs interpreter" in st.name for st in s.verdict.steps)
    assert not list(triton_oracle.cache_dir().glob("*.kdump"))


def test_a_kernel_the_interpreter_cannot_run_gets_a_note_not_a_failure(
    kernels: dict[str, Path], tmp_path: Path
) -> None:
    from kdump.replay import triton_oracle

    bundle = _record(tmp_path / "a.kdump", "scale_kernel")
    s = _session(bundle, kernels["good"])
    actual = _run(s)
    # The oracle process imports the module from --path: there it has inline assembly.
    s.req = Request(
        str(bundle),
        0,
        ReplayOptions(allow_targets=(SCALE_T,), paths=(str(kernels["asm"]),), device="cpu"),
    )
    triton_oracle.check(s, "eager/run 1", {"out_ptr": 1}, [], actual)
    (note,) = [n for n in s.verdict.notes if n.startswith("no interpreter oracle: ")]
    assert "inline_asm not supported in interpreter mode" in note and "\n" not in note
    assert not s.verdict.findings


def test_the_oracle_process_keeps_the_trust_rule(kernels: dict[str, Path], tmp_path: Path) -> None:
    """The oracle process admits the target by the patterns it is handed, not by the bundle."""
    from kdump.replay import triton_oracle

    s = _session(_record(tmp_path / "a.kdump", "scale_kernel"), kernels["good"])
    job = triton_oracle.job_for(s, {"out_ptr": 1}, [], tmp_path / "o.kdump")
    job["allow_targets"] = []
    folder = tmp_path / "job"
    folder.mkdir()
    why = triton_oracle.run_interpreter(job, folder, 300)
    assert "UntrustedTargetError" in why and "--allow-target" in why
    assert not (tmp_path / "o.kdump").exists()


def test_a_launch_option_the_installed_triton_rejects_cannot_run() -> None:
    """Recorded options are checked against the installed kernel (an option that names one of
    its parameters does not fit it), and a compiled Triton's refusal of an option it does not
    know (recorded with another Triton) is 'cannot run here', not the kernel's error."""
    from kdump.errors import CannotRunError
    from kdump.format.records import LaunchRecord
    from kdump.kernels.triton import replay as triton_replay

    class FakeJIT:  # shaped like a JITFunction of another Triton: rejects `future_option`
        arg_names = ("x", "BLOCK")

        def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            for k in kwargs:
                if k not in ("num_warps", "BLOCK"):
                    raise KeyError(f"Keyword argument {k} was specified but unrecognised")

        def __getitem__(self, grid: Any) -> Any:
            return self.run

    FakeJIT.__module__ = "triton.runtime.jit"

    def record(options: dict[str, Any]) -> LaunchRecord:
        return LaunchRecord("triton", (1,), options, ("BLOCK",), "0" * 64, "9.9.9")

    triton_replay.runner(FakeJIT(), record({"num_warps": 4}))(1, BLOCK=2)
    with pytest.raises(CannotRunError, match="rejects a recorded launch option"):
        triton_replay.runner(FakeJIT(), record({"future_option": 1}))(1, BLOCK=2)
    with pytest.raises(CannotRunError, match="'BLOCK'"):
        triton_replay.runner(FakeJIT(), record({"BLOCK": 4}))
