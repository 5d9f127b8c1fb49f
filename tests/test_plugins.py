"""Kernel plug-ins: the built-in DeepGEMM one, and a third-party one found through the
"kdump.kernels" entry-point group that records and replays a target of its own."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import load_bundle
from kdump.cli import main
from kdump.kernels import registry

ROOT = Path(__file__).parents[1]
PLUGIN_PKG = Path(__file__).parent / "plugin_pkg"
ENTRY_POINTS = """\
[kdump.kernels]
toy = kdump_toy_plugin:ToyPlugin
broken = kdump_toy_plugin:BrokenPlugin
missing = kdump_toy_plugin_absent:PLUGIN
deep_gemm = kdump_toy_plugin:ToyPlugin
"""


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The toy package importable and its entry points installed, here and in children."""
    site = tmp_path / "site"
    info = site / "kdump_toy_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kdump-toy-plugin\nVersion: 0.1\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text(ENTRY_POINTS, encoding="utf-8")
    monkeypatch.syspath_prepend(str(PLUGIN_PKG))
    monkeypatch.syspath_prepend(str(site))
    paths = [str(site), str(PLUGIN_PKG), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    registry.reload()
    import kdump_toy_plugin

    monkeypatch.setattr(kdump_toy_plugin, "BUG", False)
    yield kdump_toy_plugin
    registry.reload()


def _args(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(6, 5, generator=g, device="cpu")
    b = torch.randn(6, 5, generator=g, device="cpu")
    return a, b, torch.randn(6, 5, generator=g, device="cpu")


def _replay_cli(path: Path, backend: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--backend", backend, "--device", "cpu", "--json"])
    return int(exc.value.code), json.loads(capsys.readouterr().out)


def test_entry_point_plugin_is_found_once_and_broken_ones_skipped(
    toy, capsys: pytest.CaptureFixture[str]
) -> None:
    names = [p.name for p in registry.plugins()]
    assert names.count("deep_gemm") == 1 and names.count("toy") == 1
    assert "broken" not in names
    assert registry.plugin("deep_gemm").presets()["deep_gemm"]  # the built-in one won
    err = capsys.readouterr().err
    assert "'broken'" in err and "'missing'" in err
    registry.reload()
    registry.plugins()
    assert "'broken'" not in capsys.readouterr().err  # logged once per process
    assert "toy" in registry.backend_names() and "packaged" in registry.backend_names()
    assert registry.spec_for("kdump_toy_plugin:scaled_add").id == "toy:scaled_add"
    assert (
        registry.choose_backend(
            "auto", registry.spec_for("toy:scaled_add"), torch.device("cpu")
        ).name
        == "toy"
    )


def test_plugin_target_records_and_replays_clean(
    toy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, out = _args(1)
    with kdump.recording("toy", out=tmp_path / "rec") as rec:
        toy.scaled_add(a, b, out, 0.75)
    [path] = rec.written
    call = load_bundle(path).calls[0]
    assert call.target == "toy:scaled_add"
    assert torch.allclose(out, a * 0.75 + b)
    code, doc = _replay_cli(Path(path), "reference", capsys)
    assert code == 0, doc
    steps = doc["verdicts"][0]["steps"]
    assert any(s["name"].endswith("vs recorded") and s["status"] == "ok" for s in steps), steps
    code, doc = _replay_cli(Path(path), "toy", capsys)
    assert code == 0, doc
    assert doc["verdicts"][0]["backend"] == "toy"
    steps = doc["verdicts"][0]["steps"]
    assert any(s["name"].endswith("vs reference") and s["status"] == "ok" for s in steps), steps


def test_plugin_target_wrong_recorded_output_is_a_mismatch(
    toy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, out = _args(2)
    monkeypatch.setattr(toy, "BUG", True)  # the recorded build computes a wrong element
    kdump.dump_call(tmp_path / "bad.kdump", toy.scaled_add, a, b, out, 2.0)
    assert load_bundle(tmp_path / "bad.kdump").calls[0].target == "toy:scaled_add"
    monkeypatch.setattr(toy, "BUG", False)
    code, doc = _replay_cli(tmp_path / "bad.kdump", "reference", capsys)
    assert code == 1, doc
    [finding] = doc["verdicts"][0]["findings"]
    assert finding["kind"] == "mismatch" and "out" in finding["message"]


CORES = ("kdump/record", "kdump/replay", "kdump/doctor.py", "kdump/envinfo.py")


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_cores_import_nothing_from_a_kernel_library() -> None:
    files = [p for c in CORES for p in (sorted((ROOT / c).rglob("*.py")) or [ROOT / c])]
    assert len(files) > 10
    offenders = {
        str(f.relative_to(ROOT)): m
        for f in files
        for m in _imports(f)
        if m.startswith(("kdump.kernels.deepgemm", "kdump.kernels.sm120"))
        or m in ("kdump.kernels.backends", "kdump.kernels.backends.DeepGemmBackend")
    }
    assert offenders == {}
    assert "kdump.kernels.registry" in _imports(ROOT / "kdump/replay/session.py")


def test_deep_gemm_is_declared_as_an_entry_point() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split('[project.entry-points."kdump.kernels"]', 1)[1].split("\n[", 1)[0]
    target = section.split("deep_gemm =", 1)[1].split("\n", 1)[0].strip().strip('"')
    module, _, attr = target.partition(":")
    __import__(module)
    assert getattr(sys.modules[module], attr) is registry.plugin("deep_gemm")
