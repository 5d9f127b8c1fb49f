"""Triton kernels as recording targets (CPU, Triton's interpreter): hooked at their launch, not
replaced, so `kernel[grid](...)`, `kernel.run(...)`, autotuner and heuristics launches and
launches from other Python code keep working; both recorders write the launch record (the grid
evaluated once, the launch options, constexprs, source hash, Triton version) and the outputs;
`MODULE:*` hooks every kernel a module defines, also one imported later; unpatching leaves
the kernels as they were; a raw pointer passed as an integer is marked, never breaking the
launch; a failure inside kdump launches unrecorded."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.format.journal import SlotMeta, head_json, launch_record, parse_meta
from kdump.format.records import launch_json
from kdump.kernels.triton import launch as tl_launch
from kdump.record.config import RingConfig

pytest.importorskip("triton")

KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + tl.load(y_ptr + offs, mask=mask), mask=mask)


def _bench(kernel_call, quantiles):
    kernel_call()  # one launch per config, as a real benchmark makes (never recorded)
    return [1.0, 1.0, 1.0]


@triton.autotune(
    configs=[
        triton.Config({"BLOCK": 32}, num_warps=2),
        triton.Config({"BLOCK": 64}, num_warps=4),
    ],
    key=["n"],
    do_bench=_bench,
)
@triton.jit
def scale_kernel(x_ptr, out_ptr, n, s, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * s, mask=mask)


@triton.heuristics({"BLOCK": lambda meta: 16})
@triton.jit
def neg_kernel(x_ptr, out_ptr, n, addr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, -tl.load(x_ptr + offs, mask=mask), mask=mask)


def helper(x, y, out):
    """A launch from inside other Python code."""
    add_kernel[(triton.cdiv(x.numel(), 32),)](x, y, out, x.numel(), BLOCK=32)


NOT_A_KERNEL = 3
'''

_names = itertools.count()


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh module of Triton kernels (interpreted: CPU tensors), imported on first use."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    name = f"kd_tkern_{os.getpid()}_{next(_names)}"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{name}.py").write_text(KERNELS)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    yield name
    sys.modules.pop(name, None)


def _import(name: str) -> Any:
    import importlib

    return importlib.import_module(name)


def _ring(tmp_path: Path) -> RingConfig:
    return RingConfig(slots=16, slot_bytes=256 << 10, journal_dir=tmp_path / "shm")


def _data(n: int = 100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.float32), torch.ones(n), torch.zeros(n)


def _calls(paths: list[Path]) -> list[Any]:
    """(target, names, kwargs, launch, meta, args, outputs) of every call, in call-time order."""
    out = []
    for p in paths:
        with load_bundle(p) as b:
            for c in b.calls:
                out.append(
                    {
                        "target": c.target,
                        "called_as": c.called_as,
                        "names": c.names,
                        "kwargs": c.encoded_kwargs,
                        "launch": c.launch,
                        "meta": c.meta,
                        "args": c.args,
                        "outputs": c.outputs,
                        "encoded": c.encoded_args,
                    }
                )
    return sorted(out, key=lambda c: c["meta"].get("time_ns", 0))


@pytest.mark.parametrize("mode", ["sync", "ring"])
def test_plain_kernel_grid_function_run_and_nested_launch(tmp_path, kernels, mode):
    m = _import(kernels)
    x, y, out = _data()
    evaluated: list[int] = []

    def grid(meta: dict[str, Any]) -> tuple[int]:
        evaluated.append(meta["BLOCK"])
        return (-(-meta["n"] // meta["BLOCK"]),)

    ring = _ring(tmp_path) if mode == "ring" else None
    with kdump.recording(
        f"{kernels}:add_kernel", out=tmp_path / "out", mode=mode, ring=ring
    ) as rec:
        m.add_kernel[grid](x, y, out, 100, BLOCK=32)
        assert torch.equal(out, x + 1)
        m.add_kernel.run(x, out, out, 100, BLOCK=64, grid=(2,), warmup=False)
        assert torch.equal(out, 2 * x + 1)
        m.helper(out, y, out)
        assert torch.equal(out, 2 * x + 2)
        m.add_kernel.run(x, y, out, 100, BLOCK=32, grid=(4,), warmup=True)  # not recorded
        rec.flush()
        written = list(rec.written)
    assert evaluated == [32]  # the grid function ran once for its launch
    calls = _calls(written)
    assert len(calls) == 3, written
    jit = tl_launch.innermost(m.add_kernel)
    for c, grid_seen, block in zip(calls, [(4,), (2,), (4,)], [32, 64, 32]):
        assert c["target"] == f"{kernels}:add_kernel"
        assert list(c["names"]) == ["x_ptr", "y_ptr", "out_ptr", "n"]
        assert c["kwargs"] == {"BLOCK": block}
        launch = c["launch"]
        assert launch is not None and launch.kind == "triton"
        assert launch.grid == grid_seen
        assert launch.options == {}
        assert launch.constexprs == ("BLOCK",)
        assert launch.source_sha256 == tl_launch.source_sha256(jit)
        assert launch.version == tl_launch.triton_version()
    # inputs from before each launch, outputs after it (outputs kept by default in both modes)
    assert torch.equal(calls[0]["args"][2], torch.zeros(100))
    assert torch.equal(calls[0]["outputs"]["out_ptr"], x + 1)
    assert torch.equal(calls[2]["args"][0], 2 * x + 1)
    assert torch.equal(calls[2]["outputs"]["x_ptr"], 2 * x + 2)  # out_ptr is x_ptr there


@pytest.mark.parametrize("mode", ["sync", "ring"])
def test_autotuned_kernel_records_each_real_launch_with_its_config(tmp_path, kernels, mode):
    m = _import(kernels)
    x, _, out = _data()
    ring = _ring(tmp_path) if mode == "ring" else None
    with kdump.recording(
        f"{kernels}:scale_kernel", out=tmp_path / "out", mode=mode, ring=ring
    ) as rec:
        for s in (2.0, 3.0):  # the first launch benchmarks both configs (two launches more)
            m.scale_kernel[lambda meta: (-(-meta["n"] // meta["BLOCK"]),)](x, out, 100, s)
            assert torch.equal(out, s * x)
        rec.flush()
        written = list(rec.written)
    calls = _calls(written)
    assert len(calls) == 2, written  # one per real launch: benchmark launches pass through
    best = m.scale_kernel.best_config
    for c in calls:
        assert c["called_as"] == f"{kernels}:scale_kernel"
        assert c["kwargs"] == {"BLOCK": best.kwargs["BLOCK"]}
        assert c["launch"].options["num_warps"] == best.num_warps
        assert c["launch"].grid == (-(-100 // best.kwargs["BLOCK"]),)
    assert torch.equal(calls[1]["outputs"]["out_ptr"], 3.0 * x)


def test_heuristics_kernel_and_pointer_passed_as_int(tmp_path, kernels):
    m = _import(kernels)
    x, _, out = _data()
    with kdump.recording(f"{kernels}:neg_kernel", out=tmp_path / "out", mode="sync") as rec:
        m.neg_kernel[(7,)](x, out, 100, x.data_ptr())  # an address inside x, as an int
        m.neg_kernel[(7,)](x, out, 100, 12345)  # a plain integer
        written = list(rec.written)
    assert torch.equal(out, -x)
    first, second = _calls(written)
    assert first["kwargs"] == {"BLOCK": 16}  # the heuristics' value
    assert first["encoded"][3] == {"$pointer": x.data_ptr()}
    (note,) = first["meta"]["notes"]
    assert note.startswith("opaque-pointer: addr ")
    assert second["encoded"][3] == 12345 and "notes" not in second["meta"]


def test_module_glob_hooks_a_module_imported_later_and_unpatch_restores(tmp_path, kernels):
    assert kernels not in sys.modules
    x, y, out = _data()
    with kdump.recording(f"{kernels}:*", out=tmp_path / "out", mode="sync") as rec:
        m = _import(kernels)  # the import watcher expands the glob now
        m.helper(x, y, out)
        m.scale_kernel[(4,)](x, out, 100, 2.0)
        m.neg_kernel[(7,)](x, out, 100, 1)
        rows = {r["target"]: r["state"] for r in rec.patches.report()}
        written = list(rec.written)
    assert rows == {
        f"{kernels}:*": "patched",
        f"{kernels}:add_kernel": "patched",
        f"{kernels}:scale_kernel": "patched",
        f"{kernels}:neg_kernel": "patched",
    }
    assert sorted(c["target"].split(":")[1] for c in _calls(written)) == [
        "add_kernel",
        "neg_kernel",
        "scale_kernel",
    ]
    # unpatched: no instance attribute of kdump's left, every kernel still launches
    for k in (m.add_kernel, m.scale_kernel, m.neg_kernel):
        for obj in tl_launch.chain(k):
            assert "run" not in vars(obj) and "_bench" not in vars(obj)
    m.add_kernel[(4,)](x, y, out, 100, BLOCK=32)
    assert torch.equal(out, x + 1)
    m.scale_kernel[(4,)](x, out, 100, 5.0)
    assert torch.equal(out, 5 * x)


def test_a_failure_inside_kdump_launches_unrecorded(tmp_path, kernels, monkeypatch):
    m = _import(kernels)
    x, y, out = _data()

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("planted")

    from kdump.record import launch_hook

    monkeypatch.setattr(launch_hook.tl_launch, "launch_record", broken)
    with kdump.recording(f"{kernels}:add_kernel", out=tmp_path / "out", mode="sync") as rec:
        m.add_kernel[(4,)](x, y, out, 100, BLOCK=32)
        written = list(rec.written)
    assert written == []
    assert torch.equal(out, x + 1)


def test_journal_slot_carries_the_launch_and_stays_as_before_without_one():
    from kdump.record.launch_hook import prepare

    meta = SlotMeta(call_index=0, target="m:k", names=["a"], args=[1], kwargs={})
    assert b"launch" not in head_json(meta)  # other calls: the slot JSON of before
    jit_like = type("J", (), {"arg_names": ["a"], "params": []})()
    fn, _, _ = prepare(jit_like, lambda *a, **k: None, (3, 2), (1,), {"num_warps": 4})
    doc = launch_json(fn.kdump_launch)
    body = (
        head_json(SlotMeta(call_index=0, target="m:k", names=["a"], args=[1], launch=doc))
        + b',"storages":[],"tensors":[],"extra":{}}'
    )
    got, _ = parse_meta(body, 0, 0, 1, 0, (0, 0, 0, 0))
    assert launch_record(got.launch) == fn.kdump_launch
    assert fn.kdump_launch.grid == (3, 2) and fn.kdump_launch.options == {"num_warps": 4}
    bad = body.replace(b'"grid":[3,2]', b'"grid":"x"')
    with pytest.raises(Exception, match="wrong types"):
        parse_meta(bad, 0, 0, 1, 0, (0, 0, 0, 0))


PROGRAM = """
import torch, {mod}
x = torch.arange(100, dtype=torch.float32); y = torch.ones(100); out = torch.zeros(100)
{mod}.helper(x, y, out)
{mod}.scale_kernel[(4,)](x, out, 100, 2.0)
assert torch.equal(out, 2 * x)
print("program ok")
"""


@pytest.mark.parametrize("mode", ["sync", "ring"])
def test_kdump_record_cli_records_a_module_glob(tmp_path, kernels, mode):
    mods = tmp_path / "mods"
    (tmp_path / "prog.py").write_text(PROGRAM.format(mod=kernels))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(mods), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "kdump", "record", "-t", f"{kernels}:*", "--mode", mode]
    env["KDUMP_JOURNAL_DIR"] = str(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    cmd += ["-o", str(tmp_path / "out"), "--", sys.executable, str(tmp_path / "prog.py")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "program ok" in r.stdout
    calls = _calls(sorted((tmp_path / "out").rglob("*.kdump")))
    assert sorted(c["target"].split(":")[1] for c in calls) == ["add_kernel", "scale_kernel"]
    assert all(c["launch"] is not None and c["outputs"] is not None for c in calls)


def test_flight_recorder_repeats_keep_each_launchs_own_record(tmp_path, kernels):
    """Exact repeats of a launch take the flight recorder's template path; a launch with the
    same arguments but another grid or launch option is no repeat of it."""
    m = _import(kernels)
    x, y, out = _data()
    jit = tl_launch.innermost(m.add_kernel)
    with kdump.recording(
        f"{kernels}:add_kernel", out=tmp_path / "out", mode="ring", ring=_ring(tmp_path)
    ) as rec:
        for grid in [(4,), (4,), (4,), (4,), (7,), (4,)]:
            m.add_kernel[grid](x, y, out, 100, BLOCK=32)
        jit.run(x, y, out, 100, BLOCK=32, grid=(4,), warmup=False, num_warps=2)
        fast = rec.recorder.fast_calls
        rec.flush()
        written = list(rec.written)
    assert fast >= 2  # the template path ran (and still wrote the launch record)
    calls = _calls(written)
    assert [c["launch"].grid for c in calls] == [(4,), (4,), (4,), (4,), (7,), (4,), (4,)]
    assert [c["launch"].options for c in calls] == [{}] * 6 + [{"num_warps": 2}]
    assert torch.equal(out, x + 1)


def test_a_glob_allows_the_triton_kernels_its_module_defines(kernels):
    """`--allow-target 'MODULE:*'` (what `kdump record` suggests for a `MODULE:*` recording)
    admits the module's own Triton kernels, whose objects are of Triton's classes: the trust
    rule looks at the kernel's function."""
    from kdump.errors import UntrustedTargetError
    from kdump.kernels import registry

    m = _import(kernels)
    for name in ("add_kernel", "scale_kernel", "neg_kernel"):
        got = registry.resolve_allowed(f"{kernels}:{name}", [f"{kernels}:*"])
        assert got is getattr(m, name)
    assert registry.defined_in(m.add_kernel, kernels)
    assert not registry.defined_in(m.add_kernel, "elsewhere")
    with pytest.raises(UntrustedTargetError):
        registry.resolve_allowed("torch:nn.functional.relu", [f"{kernels}:*"])


def test_a_second_autotuner_over_a_hooked_kernel_still_benchmarks_unrecorded(tmp_path, kernels):
    """Two autotuners of one module wrapping the same JITFunction (or a target naming the inner
    kernel beside its autotuner): the launch is hooked once, but each autotuner's benchmark
    launches must still pass through unrecorded."""
    m = _import(kernels)
    import triton

    second = triton.autotune(
        configs=[triton.Config({"BLOCK": 16}, num_warps=2), triton.Config({"BLOCK": 128})],
        key=["n"],
        do_bench=m._bench,
    )(m.scale_kernel.fn)
    m.scale_again = second
    x, _, out = _data()
    with kdump.recording(f"{kernels}:*", out=tmp_path / "out", mode="sync") as rec:
        second[lambda meta: (-(-meta["n"] // meta["BLOCK"]),)](x, out, 100, 2.0)
        assert torch.equal(out, 2 * x)
        written = list(rec.written)
    assert len(_calls(written)) == 1  # the benchmark launches of both configs pass through
    assert "_bench" not in vars(second)
