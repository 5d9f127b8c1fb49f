"""Eager replays of many bundles reuse worker processes (kdump.replay.child.WorkerPool): only
between clean bundles with the same applied environment and library settings; a crash still
isolates."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls
from kdump.errors import ExitCode
from kdump.replay import replay

TESTS = Path(__file__).parent
GEN = torch.Generator().manual_seed(99)


@pytest.fixture(autouse=True)
def _child_can_import_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    pids = tmp_path / "pids"
    monkeypatch.setenv("KDUMP_TEST_PIDS", str(pids))
    # These bundles name this repository's test targets: the user's config allows them.
    (tmp_path / "kdump.toml").write_text('allow-targets = ["targets.*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))
    return pids


def _record(path: Path, fn: str, env_vars: dict[str, str] | None = None) -> Path:
    x = torch.randn(8, 4, generator=GEN, device="cpu")
    out = torch.randn(8, 4, generator=GEN, device="cpu")
    call = capture_call(f"targets.worker_targets:{fn}", [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    out.copy_(x * 2.0)
    attach_outputs(call, live, [1])
    save_calls(path, [call], env={"env_vars": env_vars or {}})
    return path


# Runs of a clean bundle replayed with repeat=1 and halo=0: three find its outputs (the recorded
# values, x probed, out probed; kdump.replay.discover), then the one run judged.
CLEAN_RUNS = 4


def _pids(tmp_path: Path, runs: list[int] | None = None) -> list[int]:
    """The pid that ran each bundle, in order: `runs[k]` calls of the target per bundle k (every
    bundle clean when not given; the tests replay with halo=0: no halo differential)."""
    seen = [int(p) for p in (tmp_path / "pids").read_text().split()]
    runs = runs or [CLEAN_RUNS] * (len(seen) // CLEAN_RUNS)
    assert sum(runs) == len(seen), (runs, seen)
    out, at = [], 0
    for n in runs:
        group = seen[at : at + n]
        assert len(set(group)) == 1, group  # one bundle, one process
        out.append(group[0])
        at += n
    return out


def test_clean_bundles_share_one_worker(tmp_path: Path) -> None:
    paths = [_record(tmp_path / f"b{i}.kdump", "scale_noting_pid") for i in range(4)]
    verdicts = replay(paths, device="cpu", repeat=1, halo=0)
    assert [v.exit_code for v in verdicts] == [0, 0, 0, 0], [v.headline() for v in verdicts]
    pids = _pids(tmp_path)
    assert len(pids) == 4 and len(set(pids)) == 1 and pids[0] != os.getpid()


def test_a_crash_still_isolates_and_its_worker_is_replaced(tmp_path: Path) -> None:
    names = ["scale_noting_pid", "crash_noting_pid", "scale_noting_pid", "scale_noting_pid"]
    paths = [_record(tmp_path / f"b{i}.kdump", fn) for i, fn in enumerate(names)]
    verdicts = replay(paths, device="cpu", repeat=1, halo=0)
    assert [v.exit_code for v in verdicts] == [0, ExitCode.KERNEL_ERROR, 0, 0]
    crash = verdicts[1]
    assert crash.bundle == str(paths[1])
    step = crash.findings[0].step
    assert step == "eager/discover outputs (recorded values)", step
    assert "SIGABRT" in crash.findings[0].message
    first, crashed, after, last = _pids(tmp_path, [CLEAN_RUNS, 1, CLEAN_RUNS, CLEAN_RUNS])
    assert first == crashed  # the worker of a clean bundle ran the crashing one
    assert after != crashed and last == after  # a fresh worker, reused again


def test_different_library_settings_get_their_own_worker(tmp_path: Path) -> None:
    a = _record(tmp_path / "a.kdump", "scale_noting_pid", {"DG_JIT_NVCC": "1"})
    b = _record(tmp_path / "b.kdump", "scale_noting_pid", {"DG_JIT_NVCC": "0"})
    a2 = _record(tmp_path / "a2.kdump", "scale_noting_pid", {"DG_JIT_NVCC": "1"})
    verdicts = replay([a, b, a2], device="cpu", repeat=1, halo=0)
    assert [v.exit_code for v in verdicts] == [0, 0, 0]
    pa, pb, pa2 = _pids(tmp_path)
    assert pa != pb and pa2 == pa


def test_a_worker_with_a_finding_is_not_reused(tmp_path: Path) -> None:
    good = _record(tmp_path / "good.kdump", "scale_noting_pid")
    bad = tmp_path / "bad.kdump"
    x = torch.randn(8, 4, generator=GEN, device="cpu")
    out = torch.randn(8, 4, generator=GEN, device="cpu")
    call = capture_call("targets.worker_targets:scale_noting_pid", [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    out.copy_(x * 3.0)  # recorded output that the target does not produce: a mismatch
    attach_outputs(call, live, [1])
    save_calls(bad, [call])
    verdicts = replay([bad, good], device="cpu", repeat=1, halo=0)
    assert [v.exit_code for v in verdicts] == [ExitCode.MISMATCH, 0]
    p_bad, p_good = _pids(tmp_path)
    assert p_bad != p_good
