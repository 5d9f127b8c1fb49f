"""The graph chain's shrinking-batch and changed-addresses steps on real CUDA graphs, end to end:
planted CUDA kernels (tests/targets/graph_steps_cuda.py) recorded with `kdump.dump_call`, then
`kdump replay BUNDLE --mode graph --routing groups:labels --json` in a process of its own.

- a kernel that keeps a descriptor of the last call's addresses: eager, capture, the identical
  replay and the shrinking batch pass; the replay after the eager call at new addresses is wrong,
  and the verdict fails naming "graph/replay changed addresses";
- a kernel that does not skip invalid rows: it writes before its output once the batch shrinks
  below the captured 32 rows per group (a guard violation); the verdict names the first
  shrinking-batch replay;
- the correct kernel passes both steps, each replay judged by its fresh eager run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kdump
from kdump.errors import ExitCode

pytestmark = pytest.mark.gpu
TESTS = Path(__file__).parent
ROOT = TESTS.parent
CHANGED = "graph/replay changed addresses"
SHRUNK = [
    f"graph/replay shrinking batch {i + 1} ({n} row{'s' * (n != 1)} per group)"
    for i, n in enumerate((31, 16, 12, 8, 1, 0))
]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    (tmp_path / "kdump.toml").write_text('allow-targets = ["targets.graph_steps_cuda:*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))


def _record(tmp_path: Path, name: str) -> Path:
    """One call of the planted kernel `name`: 4 groups of 32 valid rows, 64 columns (values 1 to 8:
    a row gathered from the wrong buffer or left zero shows)."""
    from targets import graph_steps_cuda

    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randint(1, 9, (128, 64), device="cuda", generator=gen).float()
    groups = torch.arange(4, device="cuda").repeat_interleave(32).to(torch.int32)
    out = torch.zeros(4, 64, device="cuda")
    path = tmp_path / f"{name}.kdump"
    kdump.dump_call(path, getattr(graph_steps_cuda, name), x, groups, out)
    torch.cuda.synchronize()
    want = x[31::32]  # the last row of each group
    assert torch.equal(out, want)  # the recorded call itself is right
    return path


def _replay(path: Path) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "kdump", "replay", str(path), "--mode", "graph"]
    cmd += ["--routing", "groups:labels", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.stdout.strip(), done.stderr[-3000:]
    [verdict] = json.loads(done.stdout)["verdicts"]
    return done.returncode, verdict


def _show(v: dict) -> str:
    lines = [f"  {s['name']} {s['status']} {s['message'][:200]}" for s in v["steps"]]
    return v["headline"] + "\n" + "\n".join(lines)


def _status(v: dict, name: str) -> str:
    """The worst status among the steps named `name` (comparisons and halo checks included)."""
    rank = {"error": 0, "fail": 1, "ok": 2, "skipped": 3}
    mine = [s["status"] for s in v["steps"] if s["name"].split(" vs ")[0].split("/halo")[0] == name]
    assert mine, f"no step {name}:\n{_show(v)}"
    return min(mine, key=lambda st: rank.get(st, 3))


def test_kept_descriptor_fails_at_changed_addresses(tmp_path: Path) -> None:
    code, v = _replay(_record(tmp_path, "last_rows_described"))
    print(_show(v))
    assert code == ExitCode.MISMATCH, _show(v)
    for name in ("graph/eager", "graph/capture", "graph/replay identical", *SHRUNK):
        assert _status(v, name) == "ok", f"{name}\n{_show(v)}"
    assert _status(v, f"{CHANGED} (eager call)") == "ok", _show(v)
    assert _status(v, CHANGED) == "fail", _show(v)
    assert {f["step"] for f in v["findings"]} == {CHANGED}, _show(v)
    assert v["headline"].endswith(f"(step {CHANGED})"), v["headline"]
    assert "out differs from the identical replay" in v["headline"]


def test_unchecked_rows_fail_when_the_batch_shrinks(tmp_path: Path) -> None:
    code, v = _replay(_record(tmp_path, "last_rows_unchecked"))
    print(_show(v))
    assert code == ExitCode.MEMORY_FINDING, _show(v)
    assert _status(v, "graph/replay identical") == "ok", _show(v)
    first = v["findings"][0]
    assert first["kind"] == "memory" and first["step"] == SHRUNK[0], _show(v)
    assert "the guard before out" in first["message"], first["message"]
    assert v["headline"].endswith(f"(step {SHRUNK[0]})"), v["headline"]
    assert all(f["step"].startswith("graph/replay shrinking batch") for f in v["findings"])


def test_correct_kernel_passes_both_steps(tmp_path: Path) -> None:
    code, v = _replay(_record(tmp_path, "last_rows"))
    print(_show(v))
    assert code == 0 and v["outcome"] == "clean", _show(v)
    names = {s["name"] for s in v["steps"]}
    for name in (*SHRUNK, CHANGED):
        assert _status(v, name) == "ok", f"{name}\n{_show(v)}"
        assert f"{name} vs fresh eager" in names, f"{name}\n{_show(v)}"
    assert f"{CHANGED} vs identical replay" in names
    assert _status(v, f"{CHANGED} (eager call)") == "ok"
