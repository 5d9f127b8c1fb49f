"""lab/sm120_variants.py: the packaged kernel's code paths the product no longer ships (probes,
the split of thin tiles, the branchy epilogue) restored by lab/patches/sm120_variants.patch. The
patch must still fit the shipped grouped_gemm.cu, its builds must still compile (Hopper's split
build with the shipped build's SASS properties), and on a GPU the split build must still compute
the right results."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kdump.kernels.sm120 import build, configs
from kdump.kernels.sm120.build import BuildRequest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lab(lab_import: Any) -> Any:
    return lab_import("sm120_variants")


def test_the_patch_fits_the_shipped_source(lab):
    src = lab.variant_source()
    assert src != build.kernel_source()
    for name in ("KD_SPLIT_THIN", "KD_PRED_STORES", "KD_PROBE"):
        assert name in src and name not in build.kernel_source()


def test_lab_fields_select_the_lab_config(lab):
    base = configs.CONFIGS[90]
    assert type(lab.config_of(base, {"stages": 5})) is configs.TileConfig
    cfg = lab.config_of(base, {"split_thin": 1, "stages": 5})
    assert isinstance(cfg, lab.LabConfig) and (cfg.split_thin, cfg.stages) == (1, 5)
    assert "KD_SPLIT_THIN=1" in cfg.defines() and cfg.slots == base.slots
    with pytest.raises(ValueError, match="probe"):
        lab.config_of(base, {"probe": 7}).check()


def _cuobjdump() -> str | None:
    spec = importlib.util.find_spec("nvidia")
    for loc in spec.submodule_search_locations if spec else []:
        exe = Path(loc) / "cu13" / "bin" / "cuobjdump"
        if exe.is_file():
            return str(exe)
    return None


@pytest.mark.parametrize("fields", [{"split_thin": 1}, {"probe": 4, "pred_stores": 0}])
def test_lab_builds_compile_for_hopper(lab, fields, tmp_path, monkeypatch):
    pytest.importorskip("cuda.core")
    try:
        build.cutlass_include_dir()
        build.cuda_include_dir()
    except build.PackagedKernelError as exc:
        pytest.skip(str(exc))
    cfg = lab.config_of(configs.CONFIGS[90], fields)
    patched = lab.variant_source()
    monkeypatch.setattr(build, "kernel_source", lambda: patched)
    cubin = build.build_cubin(BuildRequest("sm_90a", cfg), use_cache=False).cubin
    assert cubin[:4] == b"\x7fELF"
    exe = _cuobjdump()
    if exe is None or fields.get("probe"):
        return
    path = tmp_path / "split.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([exe, "-sass", str(path)], check=True, capture_output=True, text=True)
    parts = re.split(r"\n\s*Function : (\S+)\n", sass.stdout)
    funcs = dict(zip(parts[1::2], parts[2::2]))
    assert set(build.KERNEL_NAMES) <= set(funcs)
    for name in build.KERNEL_NAMES:
        if name.startswith("kd_gemm"):
            assert "HMMA.16816.F32" in funcs[name] and "UTMALDG" in funcs[name], name
    assert not re.findall(r"\b(LDL|STL)(\.\w+)*\b", sass.stdout), "local memory in the split build"
    out = subprocess.run([exe, "-res-usage", str(path)], capture_output=True, text=True).stdout
    launch_regs = 65536 // cfg.threads // 8 * 8
    usage = re.findall(r"Function (\w+):\s*\n\s*REG:(\d+)", out)
    assert usage and all(int(r) == launch_regs for n, r in usage if n.startswith("kd_gemm"))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [128, 256, 512, 640])
def test_split_thin_tiles_any_k_blocks(lab, k, monkeypatch):
    """Thin tiles with 1, 2, 4 and 5 K blocks in the build whose tiles of at most 32 rows split 4
    or more K blocks over both warp rows and add the sums at the end."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    t = __import__("test_sm120_gpu")
    counts = [1, 16, 33, 64, 65, 0, 100, 8]
    labels = t.labels_for(counts, 128)
    p = t.Problem((labels.numel(),), len(counts), 256, k, True, seed=k)
    d = t.poisoned((labels.numel(), 256))
    with lab.lab_config(split_thin=1):
        t.sm120.m_grouped_fp8_gemm_nt_contiguous(p.a, p.b, d, labels)
        t.torch.cuda.synchronize()
    t.check_contiguous(p, labels, d)
    del sys.modules["test_sm120_gpu"]
