"""GPU verdict tests with planted CUDA kernels (tests/targets/cuda_planted.py): a missing barrier
named by racecheck, and the first-call-sized workspace (the capture-unsafe class) caught at the
changed-routing replay by the fresh-eager oracle and located by memcheck."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls
from kdump.cuda.tools import find_tool
from kdump.errors import ExitCode
from kdump.replay import replay

pytestmark = pytest.mark.gpu
TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def _child_can_import_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    (tmp_path / "kdump.toml").write_text('allow-targets = ["targets.*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))


def _save(path: Path, target: str, args: list, names: list[str], out: int, want: torch.Tensor):
    call = capture_call(target, args, {}, names=names)
    live = input_tensors(call, args, {})
    live[out].copy_(want)
    attach_outputs(call, live, [out])
    return save_calls(path, [call])


def _sanitizer() -> None:
    if not find_tool("compute-sanitizer"):
        pytest.skip("compute-sanitizer is not installed here")


def _show(v) -> str:
    return v.headline() + "\n" + "\n".join(f"  {s.name} {s.status} {s.message}" for s in v.steps)


def test_missing_barrier_named_by_racecheck(tmp_path: Path) -> None:
    _sanitizer()
    x = torch.randn(4096, device="cuda")
    want = x + x.view(-1, 256).roll(-1, 1).reshape(-1)
    path = _save(
        tmp_path / "race.kdump",
        "targets.cuda_planted:neighbour_sum",
        [x, torch.zeros_like(x)],
        ["x", "out"],
        1,
        want,
    )
    [v] = replay([path], mode="sanitizer", tools=["racecheck"], timeout=300)
    print(_show(v))
    assert v.exit_code == ExitCode.MEMORY_FINDING, _show(v)
    [f, *_] = [f for f in v.findings if f.kind == "memory"]
    assert f.message.startswith("racecheck:"), f.message
    assert "neighbour_sum" in f.message and f.details.get("hazard"), f.message


def _workspace_bundles(tmp_path: Path) -> list[Path]:
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(256, 64, device="cuda", generator=gen)
    out = torch.zeros(256, 64, device="cuda")
    paths = []
    for name, valid in (("a", 100), ("b", 200)):
        labels = torch.full((256,), -1, dtype=torch.int32, device="cuda")
        labels[:valid] = 0
        want = torch.zeros_like(out)
        want[:valid] = 2 * x[:valid]
        paths.append(
            _save(
                tmp_path / f"{name}.kdump",
                "targets.cuda_planted:workspace_double",
                [x, labels, out.clone()],
                ["x", "labels", "out"],
                2,
                want,
            )
        )
    return paths


def test_first_call_workspace_named_capture_unsafe(tmp_path: Path) -> None:
    a, b = _workspace_bundles(tmp_path)
    for path in (a, b):
        [eager] = replay([path], repeat=2)
        assert eager.exit_code == 0, _show(eager)
    [v] = replay([a], mode="graph", then=[str(b)], mutations=0)
    print(_show(v))
    assert v.exit_code == ExitCode.MISMATCH, _show(v)
    steps = {s.name: s for s in v.steps}
    assert steps["graph/capture"].status == "ok"
    assert steps["graph/replay identical"].status == "ok"
    fresh = [s for n, s in steps.items() if n.startswith("graph/replay 1") and "fresh" in n]
    assert fresh and fresh[0].status == "fail", _show(v)
    assert "capture-unsafe" in fresh[0].message
    assert any("capture-unsafe" in f.message for f in v.findings)
    assert not [f for f in v.findings if not f.step.startswith("graph/replay 1")], _show(v)

    _sanitizer()
    [m] = replay(
        [a],
        mode="sanitizer",
        sanitize_graph=True,
        then=[str(b)],
        mutations=0,
        timeout=300,
    )
    print(_show(m))
    writes = [f for f in m.findings if f.kind == "memory" and "write" in f.message]
    assert writes, _show(m)
    first = writes[0]
    assert "compact_rows" in first.message
    where = first.details["location"]["text"]
    # The scratch buffer belongs to the library: the address is in no argument.
    assert "not an argument" in where or "in no argument" in where, where
    assert m.exit_code in (ExitCode.MEMORY_FINDING, ExitCode.KERNEL_ERROR), _show(m)
