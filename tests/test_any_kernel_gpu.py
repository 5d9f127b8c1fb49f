"""Verdicts on a user's own CUDA kernels recorded the README's way: `kdump record -t mod:fn` (the
flight recorder) around a serving-like loop (eager warm-up, capture, replays after in-place
routing changes), then `kdump replay` of what it salvaged, with no options."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kdump.bundle import load_bundle
from kdump.cuda.tools import find_tool

pytestmark = pytest.mark.gpu
TESTS = Path(__file__).parent
ROOT = TESTS.parent
KDUMP = [sys.executable, "-m", "kdump"]

LOOP = """
import sys
import torch
from targets import cuda_planted as k

fn, rows, cols = getattr(k, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
batches = [int(n) for n in sys.argv[4].split(",")]
x = torch.randn(rows, cols, device="cuda")
labels = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
out = torch.zeros(rows, cols, device="cuda")
labels[:4] = 0
fn(x, labels, out)  # eager warm-up: the first call
torch.cuda.synchronize()
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    fn(x, labels, out)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    fn(x, labels, out)
for n in batches:  # each replay after an in-place change of the routing and activations
    labels.fill_(-1)
    labels[:n] = 0
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
print("loop done")
"""


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    (tmp_path / "kdump.toml").write_text('allow-targets = ["targets.cuda_planted:*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))


def _record(tmp_path: Path, fn: str, rows: int, cols: int, batches: str):
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(LOOP))
    out = tmp_path / "out"
    cmd = [*KDUMP, "record", "-t", f"targets.cuda_planted:{fn}", "-o", str(out), "--"]
    cmd += [sys.executable, str(script), fn, str(rows), str(cols), batches]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    return r, sorted(out.rglob("journal-*.kdump"))


def _replay(path: Path, *opts: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "250"}
    cmd = [*KDUMP, "replay", str(path), *opts]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _last_replay(bundles: list[Path]) -> Path:
    graphs = [p for p in bundles if "graph_replay" in load_bundle(p).info]
    assert graphs, bundles
    return max(graphs, key=lambda p: load_bundle(p).calls[-1].meta["journal"]["replay"])


def test_the_clean_kernel_stays_clean_in_every_mode(tmp_path: Path) -> None:
    r, bundles = _record(tmp_path, "double_rows", 256, 64, "4,3,8,200")
    assert r.returncode == 0 and "loop done" in r.stdout, r.stderr
    last = _last_replay(bundles)
    call = load_bundle(last).calls[-1]
    assert call.has_outputs, call.meta  # the flight recorder kept the replay's outputs
    rep = _replay(last)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "outputs found by running" in rep.stdout and "verdict: clean" in rep.stdout
    eager = _replay(bundles[0], "--mode", "eager", "--repeat", "5")
    assert eager.returncode == 0 and "verdict: clean" in eager.stdout, eager.stdout
    if find_tool("compute-sanitizer"):
        san = _replay(last, "--mode", "sanitizer", "--graph")
        assert san.returncode == 0, san.stdout + san.stderr


def test_a_first_call_workspace_is_named_capture_unsafe(tmp_path: Path) -> None:
    """The replay with more rows than the first call writes past the library's scratch (inside
    its allocation granule: no fault) and leaves rows unwritten."""
    r, bundles = _record(tmp_path, "workspace_double", 256, 64, "4,3,8")
    assert r.returncode == 0, r.stderr
    rep = _replay(_last_replay(bundles))
    text = " ".join(rep.stdout.split())
    assert rep.returncode == 1, rep.stdout + rep.stderr
    assert "capture-unsafe" in text or "differs from the recorded output" in text, text


def test_a_fault_on_a_changed_batch_replay_ends_in_the_sanitizer_finding(tmp_path: Path) -> None:
    """Production dies with an illegal address when a replay brings every row (the scratch was
    sized for 4); the default replay of its salvaged bundle escalates to memcheck."""
    if not find_tool("compute-sanitizer"):
        pytest.skip("compute-sanitizer is not installed here")
    r, bundles = _record(tmp_path, "workspace_double", 16384, 2048, "4,3,16384")
    died = "illegal" in r.stderr.lower() or r.returncode != 0
    assert died, r.stdout + r.stderr
    last = _last_replay(bundles)
    meta = load_bundle(last).calls[-1].meta
    assert meta["crash"].get("at_this_call") is not False, meta["crash"]
    rep = _replay(last)
    text = " ".join(rep.stdout.split())
    assert rep.returncode in (3, 4), rep.stdout + rep.stderr
    if rep.returncode == 4:
        assert "production crashed at this call" in text, text
        assert "compact_rows" in text, text
