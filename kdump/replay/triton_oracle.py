"""The interpreter oracle: a Triton launch replayed compiled on a GPU is compared with the same
launch run through Triton's interpreter (TRITON_INTERPRET=1: numpy on the CPU), which shares no
code with the compiler's backend, so a miscompiled or mis-launched kernel (a wrong mask, a
layout the compiled code reads wrongly, a launch option that changes the result) shows.

The interpreter needs its own process: whether `@triton.jit` compiles or interprets is decided
when the kernel's module is imported. That process (`python -m kdump.replay.interpret JOB`) is
given the bundle, the call, the trust decision (allowed targets, --path folders) and which
outputs to poison and keep; it imports the installed kernel under the same trust rule, runs the
recorded launch on the recorded inputs (with the same poisoned halos as the compiled replay) and
writes the kept outputs as a one-call kdump bundle. It runs within a time budget (BUDGET_S; a
kernel that takes longer has no interpreter oracle, said in a note) and its outputs are cached,
keyed by everything that decides them (the call's input bytes by their digests, the argument
tree, the launch record, the installed kernel's source hash, the Triton version, the outputs
asked for), under $KDUMP_CACHE_DIR/triton-interpreter: every later replay of the same inputs
compares without running it again.

A kernel the interpreter cannot run (inline assembly, a construct it lacks) gets "no interpreter
oracle: <why>" as a note; only a disagreement is a finding.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdump import config
from kdump.bundle import load_bundle
from kdump.errors import BundleError
from kdump.kernels.triton import launch as tl_launch
from kdump.kernels.triton import replay as triton_replay
from kdump.replay import procs
from kdump.replay.compare import _expand_mask, agree, interpreter_tolerance, unwritten
from kdump.replay.session import Session

ORACLE = "interpreter"
TRITON_ALIGN = 16  # the pointer divisibility Triton specialises a kernel on
BUDGET_S = 120.0  # seconds the interpreter may run one launch
CACHE_ENTRIES = 256  # newest cached results kept
ENTRY = "kdump.replay.interpret"  # the oracle process's module
JOB, RESULT, ERROR = "job.json", "outputs.kdump", "error.json"
STDERR_TAIL = 600


@dataclass(frozen=True)
class InterpreterRun:
    """What the interpreter gave for one launch: outputs by tensor index, or why none."""

    outputs: dict[int, torch.Tensor] | None
    why: str = ""
    cached: bool = False
    seconds: float = 0.0


def job_for(s: Session, outputs: dict[str, int], poisoned: list[str], out: Path) -> dict[str, Any]:
    """The oracle process's request: the call, the trust decision, what to poison and keep."""
    return {
        "bundle": os.path.abspath(s.req.bundle),
        "call": s.call.index,
        "allow_targets": list(s.req.options.allow_targets),
        "paths": [os.path.abspath(p) for p in s.req.options.paths],
        "halo": s.req.options.halo if s.placement().halo else 0,
        "outputs": sorted(set(outputs.values())),
        "poison": sorted(outputs[n] for n in poisoned if n in outputs),
        "out": str(out),
    }


def cache_key(s: Session, job: dict[str, Any]) -> str:
    """SHA-256 of everything that decides the interpreter's outputs (not where the bundle is,
    nor the addresses the call saw)."""
    call = s.call
    storages = [
        {
            "blobs": list(st.blobs),
            "source": str(st.source),
            "storage_nbytes": st.storage_nbytes,
            "span": [st.span_start, st.span_nbytes],
            "ranges": [list(r) for r in st.ranges],
            "generator": repr(st.generator),
            "stats": repr(st.stats),
        }
        for st in call.storages
    ]
    launch = call.launch
    assert launch is not None and s.kernel is not None
    key = {
        "target": call.target,
        "storages": storages,
        # a tensor's layout and its address modulo the alignment a replay keeps (Triton
        # specialises on 16-byte alignment: TRITON_ALIGN), not the address itself
        "tensors": [
            [
                t.storage,
                t.dtype,
                list(t.shape),
                list(t.stride),
                t.storage_offset,
                t.data_ptr % TRITON_ALIGN,
            ]
            for t in call.tensors
        ],
        "args": call.encoded_args,
        "kwargs": call.encoded_kwargs,
        "launch": triton_replay.launch_key(launch),
        "installed": tl_launch.source_sha256(tl_launch.innermost(s.kernel)),
        "triton": triton_replay.installed_version(),
        "halo": job["halo"],
        "outputs": job["outputs"],
        "poison": job["poison"],
    }
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def cache_dir() -> Path:
    root = config.get("KDUMP_CACHE_DIR") or str(Path.home() / ".cache" / "kdump")
    return Path(root).expanduser() / "triton-interpreter"


def _cached(path: Path, device: torch.device) -> dict[int, torch.Tensor] | None:
    if not path.exists():
        return None
    try:
        return _read_outputs(path, device)
    except (BundleError, OSError, ValueError, KeyError):
        with contextlib.suppress(OSError):
            path.unlink()  # a damaged entry is computed again
        return None


def _read_outputs(path: Path, device: torch.device) -> dict[int, torch.Tensor]:
    """The outputs file: a one-call bundle whose call's arguments are the kept outputs, its
    meta listing their tensor indices in the replayed call."""
    call = load_bundle(path).call(0)
    indices = call.meta.get("tensor_indices")
    if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
        raise ValueError("no tensor indices")
    mc = call.materialize(device)
    if len(mc.tensors) != len(indices):
        raise ValueError("tensor count")
    return dict(zip(indices, mc.tensors))


def _store(result: Path, path: Path) -> None:
    """Move a fresh result into the cache (atomically), keeping the newest CACHE_ENTRIES."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(result.read_bytes())
        os.replace(tmp, path)
        entries = sorted(path.parent.glob("*.kdump"), key=lambda p: p.stat().st_mtime)
        for old in entries[:-CACHE_ENTRIES]:
            old.unlink()
    except OSError:
        pass  # a cache that cannot be written only costs a rerun


def oracle_environment() -> dict[str, str]:
    """The oracle process's environment: the interpreter on, no GPU, never recorded, no
    current folder on its import path (kdump.replay.child's rule for replay processes)."""
    env = config.environ()
    env.pop("KDUMP_RECORD", None)
    env[triton_replay.INTERPRET_VAR] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONSAFEPATH"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    root = str(Path(__file__).resolve().parents[2])
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root == os.path.realpath(os.getcwd()) and root not in entries:
        env["PYTHONPATH"] = os.pathsep.join([*entries, root])
    return env


def run_interpreter(job: dict[str, Any], folder: Path, budget: float) -> str:
    """Run the oracle process for `job` in `folder`; '' when it wrote its outputs, else why
    not (one line)."""
    (folder / JOB).write_text(json.dumps(job))
    cmd = [sys.executable, "-m", ENTRY, str(folder / JOB), str(os.getpid())]
    # Same process group as this replay: whatever ends the replay ends the oracle too.
    proc = subprocess.Popen(
        cmd,
        env=oracle_environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    try:
        _, err = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"ran past the {budget:g} s budget"
    except BaseException:
        proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        raise
    if (folder / ERROR).exists():
        try:
            said = json.loads((folder / ERROR).read_text()).get("error", "")
        except ValueError:
            said = ""
        return str(said) or "the interpreter failed"
    if proc.returncode == 0 and Path(job["out"]).exists():
        return ""
    lines = [ln.strip() for ln in (err or "").splitlines() if ln.strip()]
    tail = f": {lines[-1][:STDERR_TAIL]}" if lines else ""
    return f"the interpreter process ended with exit status {proc.returncode}{tail}"


def interpreter_outputs(
    s: Session, outputs: dict[str, int], poisoned: list[str], budget: float = BUDGET_S
) -> InterpreterRun:
    """The interpreter's outputs for the call `s` replays (from the cache when it has them)."""
    with procs.temp_folder("kdump-interpret-") as folder:
        job = job_for(s, outputs, poisoned, folder / RESULT)
        path = cache_dir() / f"{cache_key(s, job)}.kdump"
        found = _cached(path, s.device)
        if found is not None:
            return InterpreterRun(found, cached=True)
        t0 = time.perf_counter()
        why = run_interpreter(job, folder, budget)
        seconds = time.perf_counter() - t0
        if why:
            return InterpreterRun(None, why, seconds=seconds)
        try:
            got = _read_outputs(folder / RESULT, s.device)
        except (BundleError, OSError, ValueError, KeyError) as exc:
            return InterpreterRun(None, f"its outputs could not be read ({exc})", seconds=seconds)
        _store(folder / RESULT, path)
        return InterpreterRun(got, seconds=seconds)


def judge(
    s: Session,
    step: str,
    outputs: dict[str, int],
    actual: dict[str, torch.Tensor],
    run: InterpreterRun,
    explained: dict[str, torch.Tensor] | None = None,
) -> None:
    """A "vs interpreter" step per output (and a mismatch finding where one disagrees beyond
    the interpreter tolerance); a note when there is no interpreter result. Elements both left
    unwritten (poison) agree; elements read from a halo (`explained`) are the over-read's."""
    if run.outputs is None:
        s.note(f"no interpreter oracle: {run.why}")
        return
    how = " (cached)" if run.cached else f" ({run.seconds:.1f} s)"
    for name, idx in outputs.items():
        got, want = actual[name], run.outputs.get(idx)
        if want is None:
            continue
        want = want.to(got.device)
        mask = _expand_mask(s.spec.meaningful({}, name), got)
        if got.dtype.is_floating_point:
            mask = mask & ~(unwritten(got) & unwritten(want))
        if explained and name in explained:
            mask = mask & ~explained[name].to(got.device)
        ag = agree(got, want, mask, tol=interpreter_tolerance(want, mask))
        verb = "matches" if ag.ok else "differs from"
        s.step(
            f"{step} vs {ORACLE}",
            "ok" if ag.ok else "fail",
            f"{name} {verb} Triton's interpreter{how}: {ag.message}",
            **_plain(ag.metrics),
        )
        if not ag.ok:
            s.finding(
                "mismatch",
                step,
                f"{name} differs from Triton's interpreter running the same launch: {ag.message}",
                {"output": name, "oracle": ORACLE, **_plain(ag.metrics)},
            )


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics without the keys that would clash with Step's own fields."""
    return {k: v for k, v in metrics.items() if k not in ("message", "name", "status")}


def check(
    s: Session,
    step: str,
    outputs: dict[str, int],
    poisoned: list[str],
    actual: dict[str, torch.Tensor],
    explained: dict[str, torch.Tensor] | None = None,
    budget: float = BUDGET_S,
) -> None:
    """Run (or find cached) the interpreter's result of the call and judge `actual` by it."""
    s.progress("begin", f"{step} vs {ORACLE}")
    judge(s, step, outputs, actual, interpreter_outputs(s, outputs, poisoned, budget), explained)
