"""The pytest plugin: bundles as test items, outcomes, one GPU per xdist worker, the fixture."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls
from kdump.pytest_plugin import gpu_for_worker, outcome
from kdump.replay.verdict import Finding, Verdict

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
CAPTURES = ROOT / "captures"
GEN = torch.Generator().manual_seed(9)


def _installed() -> bool:
    """Whether the plugin's entry point is installed (then pytest loads it without -p)."""
    from importlib.metadata import entry_points

    return any(ep.value == "kdump.pytest_plugin" for ep in entry_points(group="pytest11"))


BASE = [*([] if _installed() else ["-p", "kdump.pytest_plugin"]), "-p", "no:cacheprovider", "-q"]
CPU = ["--kdump-backend", "reference", "--kdump-device", "cpu"]


def pytest_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    inherited = os.environ.get("PYTHONPATH", "")
    paths = [str(ROOT), str(TESTS), *([inherited] if inherited else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", *BASE, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_plugin_import_is_light() -> None:
    code = "import sys, kdump.pytest_plugin; print(sorted(m for m in sys.modules if m in "
    code += "('torch', 'kdump.bundle', 'kdump.replay')))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_gpu_for_worker() -> None:
    assert gpu_for_worker("gw0", ["0", "1"]) == "0"
    assert gpu_for_worker("gw1", ["5", "7"]) == "7"
    assert gpu_for_worker("gw5", ["0", "1", "2"]) == "2"
    assert gpu_for_worker("gw1", ["0"]) is None  # one GPU: nothing to spread
    assert gpu_for_worker(None, ["0", "1"]) is None
    assert gpu_for_worker("master", ["0", "1"]) is None


def _verdict(*kinds: str) -> Verdict:
    v = Verdict("b.kdump", 0, "m:f", "eager")
    v.findings = [Finding(k, "eager/run 1", f"{k} seen at [3, 5]") for k in kinds]
    return v


def test_outcome_of_verdicts() -> None:
    assert outcome([_verdict(), _verdict()]) == ("passed", "")
    result, why = outcome([_verdict(), _verdict("cannot_run")])
    assert result == "skipped" and "cannot_run seen" in why
    result, why = outcome([_verdict("cannot_run"), _verdict("mismatch")])
    assert result == "failed" and "exit 1" in why and "mismatch seen at [3, 5]" in why


def test_captures_pass_as_items() -> None:
    res = pytest_run(["--kdump", "captures/", *CPU, "-v", "-v"], ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    n = len(list(CAPTURES.glob("*.kdump")))
    assert f"{n} passed" in res.stdout
    assert "captures/contiguous_ue8m0.kdump::[eager] PASSED" in res.stdout
    assert "tests/" not in res.stdout  # --kdump replaces the project's testpaths


@pytest.mark.skipif(
    importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed"
)
def test_captures_pass_under_xdist() -> None:
    res = pytest_run(["--kdump", "captures/", *CPU, "-n", "2"], ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(list(CAPTURES.glob('*.kdump')))} passed" in res.stdout


def _bundle(path: Path, corrupt: bool) -> Path:
    from targets import replay_targets

    x = torch.randn(16, 8, generator=GEN)
    out = torch.empty(16, 8)
    call = capture_call("targets.replay_targets:scale_into", [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    replay_targets.scale_into(x, out)
    attach_outputs(call, live, [1])
    if corrupt:
        call.outputs.data[0][4 * (3 * 8 + 5) + 2] ^= 0x40  # a high mantissa bit of out[3, 5]
    return save_calls(path, [call])


def test_failing_bundle_fails_and_fixture_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    _bundle(bundles / "bad.kdump", corrupt=True)
    good = _bundle(tmp_path / "good.kdump", corrupt=False)
    (tmp_path / "test_uses_fixture.py").write_text(
        textwrap.dedent(
            f"""
            import pytest

            @pytest.mark.kdump({good.name!r})
            def test_marked(kdump_replay):
                v = kdump_replay(device="cpu")
                assert v.exit_code == 0, v.headline()

            def test_explicit(kdump_replay):
                v = kdump_replay({str(bundles / "bad.kdump")!r}, device="cpu")
                assert v.exit_code == 1 and "[3, 5]" in v.headline()
            """
        )
    )
    res = pytest_run(
        [
            "test_uses_fixture.py",
            "--kdump",
            "bundles",
            "--kdump-device",
            "cpu",
            "--kdump-allow-target",
            "targets.replay_targets:scale_into",
        ],
        tmp_path,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "1 failed, 2 passed" in res.stdout
    assert "bundles/bad.kdump::[eager]" in res.stdout
    assert "mismatch" in res.stdout and "[3, 5]" in res.stdout


def test_ini_paths_are_collected_with_testpaths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    (tmp_path / "bundles").mkdir()
    _bundle(tmp_path / "bundles" / "good.kdump", corrupt=False)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nkdump_paths = bundles\nkdump_device = cpu\nkdump_allow_targets = targets.*\n"
    )
    res = pytest_run(["-v", "-v"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "bundles/good.kdump::[eager] PASSED" in res.stdout and "1 passed" in res.stdout


def test_cannot_run_skips_with_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("graph replays run on this machine; the skip path needs one without a GPU")
    res = pytest_run(
        ["--kdump", "captures/masked_ue8m0.kdump", "--kdump-mode", "graph", *CPU, "-rs"], ROOT
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 skipped" in res.stdout and "needs a CUDA GPU" in res.stdout
