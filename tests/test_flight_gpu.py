"""The flight recorder on a GPU: the MoE decode loop under `kdump record`, salvage of the failing
graph replay with its activations from the device tier (valid rows bitwise against what the loop
fed), and `kdump replay` of it reproducing the failure without options."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdump.bundle import load_bundle

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "moe_decode.py"
FAULTY = "kdump.kernels.sm120.faulty:m_grouped_fp8_gemm_nt_contiguous"


def _record(tmp_path: Path, backend: str, target: str) -> subprocess.CompletedProcess[str]:
    fed = tmp_path / "fed"
    fed.mkdir()
    env = dict(os.environ, MOE_DECODE_FED=str(fed))
    cmd = [sys.executable, "-m", "kdump", "record", "-t", target, "-o", str(tmp_path / "out")]
    cmd += ["--", sys.executable, str(EXAMPLE), "--backend", backend, "--steps", "6"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


def _salvaged(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "out").rglob("journal-*.kdump"))


def test_faulty_loop_salvages_the_failing_replay_and_replay_reproduces_it(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    r = _record(tmp_path, "faulty", FAULTY)
    assert r.returncode != 0, r.stdout + r.stderr  # the loop detects the stale schedule
    replays = [p for p in _salvaged(tmp_path) if "graph_replay" in load_bundle(p).info]
    assert replays, r.stderr
    # the failing step is the last one fed; its tier's graph (captured in tier order: 4, 16)
    # holds the values in the slot of its first GEMM (site 0), refreshed by that replay
    step = max(int(p.stem.split("-")[1]) for p in (tmp_path / "fed").glob("step-*.pt"))
    fed = torch.load(tmp_path / "fed" / f"step-{step}.pt")
    graph = [4, 16].index(fed["tier"]) + 1

    def facts(p: Path) -> dict:
        return load_bundle(p).calls[-1].meta["journal"]

    (failing,) = [p for p in replays if (facts(p)["graph"], facts(p)["site"]) == (graph, 0)]
    with load_bundle(failing) as b:
        call = b.calls[-1]
        assert call.meta["journal"]["replay"] >= 1
        # the activations come from the device tier: the rows the GEMM reads, bit for bit; the
        # padding rows it never reads are zero-filled and the bundle says so
        device = call.meta["journal"]["device"]
        assert "missing" not in device, device
        assert "zero-filled" in device["untouched_rows"]
        a, sfa = call.args[0]
        keep = fed["labels"] >= 0
        assert device["rows_kept"] == int(keep.sum())
        assert torch.equal(a.view(torch.uint8)[keep], fed["a"].view(torch.uint8)[keep])
        assert torch.equal(sfa[keep], fed["sfa"][keep]) and torch.equal(call.args[3], fed["labels"])
        assert not a.view(torch.uint8)[~keep].any() and not sfa[~keep].any()
        assert b.info["graph_replay"]["graph"] == graph
    rep = subprocess.run(
        [sys.executable, "-m", "kdump", "replay", str(failing), "--backend", "packaged-faulty"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert rep.returncode in (1, 4), rep.stdout + rep.stderr  # wrong values or stray writes
    assert "graph" in rep.stdout


def test_packaged_loop_salvages_every_replay_with_its_rows(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = "kdump.kernels.sm120.api:m_grouped_fp8_gemm_nt_contiguous"
    r = _record(tmp_path, "packaged", target)
    assert r.returncode == 0, r.stdout + r.stderr
    fed = tmp_path / "fed"
    last = {}  # tier -> the last step fed to it: what its graph's site-0 slot holds at exit
    for p in sorted(fed.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1])):
        f = torch.load(p)
        last[f["tier"]] = f
    seen = 0
    for p in _salvaged(tmp_path):
        with load_bundle(p) as b:
            info = b.info.get("graph_replay")
            call = b.calls[-1]
            if info is None or info["site"] != 0:
                continue
            f = last[[4, 16][info["graph"] - 1]]
            keep = f["labels"] >= 0
            a, sfa = call.args[0]
            assert torch.equal(call.args[3], f["labels"])
            assert torch.equal(a.view(torch.uint8)[keep], f["a"].view(torch.uint8)[keep])
            assert torch.equal(sfa[keep], f["sfa"][keep])
            assert "device-ring" in call.meta["tiers"]
            seen += 1
    assert seen == 2, r.stderr


def test_deep_gemm_loop_records_and_replays_clean(tmp_path):
    pytest.importorskip("deep_gemm")
    r = _record(tmp_path, "deep_gemm", "deep_gemm")
    assert r.returncode == 0, r.stdout + r.stderr
    bundles = _salvaged(tmp_path)
    assert any("graph_replay" in load_bundle(p).info for p in bundles)
    replay = next(p for p in bundles if "graph_replay" in load_bundle(p).info)
    rep = subprocess.run(
        [sys.executable, "-m", "kdump", "replay", str(replay), "--backend", "deep_gemm"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert rep.returncode == 0, rep.stdout + rep.stderr
