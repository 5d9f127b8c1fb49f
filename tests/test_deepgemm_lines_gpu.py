"""A real DeepGEMM build of today's lines (upstream 2.8.x, deepinfer-gemm, tokenspeed-deepgemm,
sgl-deep-gemm) on a GPU: kdump names the build, reads its runtime signature, records a grouped
GEMM through it with the new setters, and replays the bundle through it and the reference.
Skipped without CUDA or without an importable `deep_gemm`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

FP8 = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
NAMES = ("m_grouped_fp8_fp4_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_contiguous")


def _deep_gemm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return pytest.importorskip("deep_gemm")


def _entry_name(dg) -> str:
    return next(n for n in NAMES if hasattr(dg, n))


def test_the_installed_build_is_named_and_its_signature_read() -> None:
    dg = _deep_gemm()
    from kdump.kernels.deepgemm import build, state
    from kdump.kernels.deepgemm.plugin import PLUGIN

    facts = build.module_build(dg)
    assert facts["file"] == dg.__file__
    assert facts.get("version") or facts.get("module_version"), facts
    names = PLUGIN.param_names(FP8, getattr(dg, _entry_name(dg)))
    assert names is not None and names[:4] == ("a", "b", "d", "grouped_layout"), names
    assert state.api_of(dg) in ("pybind", "python", "torch.ops", "python over torch.ops")
    assert build.jit_line(dg) in ("deepjit", "legacy")  # a real build has its extension


def test_a_call_recorded_through_the_build_replays_clean(tmp_path: Path) -> None:
    dg = _deep_gemm()
    os.environ.setdefault("DG_JIT_CACHE_DIR", "/tmp/dg-jit")
    import kdump
    from kdump.bundle import load_bundle
    from kdump.kernels.deepgemm.plugin import PLUGIN
    from kdump.kernels.registry import spec_for
    from kdump.replay import replay

    spec = spec_for(FP8)
    fmt = "fp32" if torch.cuda.get_device_capability()[0] == 9 else "ue8m0"
    args, kwargs = spec.generate(
        seed=3, device="cuda", num_groups=4, n=512, k=512, expected_m=64, scale_format=fmt
    )
    name = _entry_name(dg)
    if "epilogue" in (PLUGIN.param_names(FP8, getattr(dg, name)) or ()):
        kwargs["epilogue"] = None  # the argument every GEMM gained, given as the default
    with kdump.recording("deep_gemm", out=tmp_path / "out") as rec:
        if hasattr(dg, "use_deterministic_algorithms"):
            dg.use_deterministic_algorithms(False)
        getattr(dg, name)(*args, **kwargs)  # looked up inside: the hooked attribute
        torch.cuda.synchronize()
    [path] = rec.written
    lib = load_bundle(path).env["libraries"]["deep_gemm"]
    assert lib["build"]["file"] == dg.__file__
    assert lib["jit"]["settings"]["CACHE_DIR"]["value"]
    if hasattr(dg, "use_deterministic_algorithms"):
        assert lib["setters"]["use_deterministic_algorithms"] is False
    for backend in ("deep_gemm", "reference"):
        [v] = replay([path], backend=backend)
        assert v.exit_code == 0, f"{backend}: {v.headline()}"
