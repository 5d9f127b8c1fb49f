"""Recording real CUDA calls (GPU machine): DeepGEMM's grouped GEMM round trip, graph capture."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import load_bundle

pytestmark = pytest.mark.gpu

STANDINS = Path(__file__).parent / "standins"


def _real_deep_gemm():
    spec = importlib.util.find_spec("deep_gemm")
    if spec is None or spec.origin is None or Path(spec.origin).is_relative_to(STANDINS):
        pytest.skip("the real deep_gemm wheel is not installed here")
    import deep_gemm

    return deep_gemm


def _contiguous_inputs(groups: int = 8, n: int = 512, k: int = 1024, seed: int = 0):
    """Aligned groups (multiples of 128 rows), -1 padding, FP8 clamped to ±448, SM90 fp32
    scales: A per token per 128-K block, MN-major TMA-aligned; B per 128×128 block."""
    g = torch.Generator().manual_seed(seed)
    align = 128
    sizes = torch.randint(1, 3 * align, (groups,), generator=g).tolist()
    padded = [(s + align - 1) // align * align for s in sizes]
    m = sum(padded)
    layout = torch.full((m,), -1, dtype=torch.int32)
    start = 0
    for gi, (s, p) in enumerate(zip(sizes, padded)):
        layout[start : start + s] = gi
        start += p
    kb, nb = k // 128, n // 128
    a = (torch.randn(m, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    m4 = (m + 3) // 4 * 4
    sfa = (torch.rand(kb, m4, generator=g) + 0.5).t()[:m]  # stride(-2)=1, stride(-1)=align(M,4)
    b = (torch.randn(groups, n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    sfb = torch.rand(groups, nb, kb, generator=g) + 0.5
    d = torch.randn(m, n, generator=g).to(torch.bfloat16)
    cuda = lambda t: t.cuda() if t.is_contiguous() else _to_cuda_strided(t)  # noqa: E731
    return (cuda(a), cuda(sfa)), (cuda(b), cuda(sfb)), cuda(d), cuda(layout)


def _to_cuda_strided(t: torch.Tensor) -> torch.Tensor:
    base = t.t().contiguous().cuda()  # keeps the MN-major layout of the scale tensor
    return base.t()


def test_real_deep_gemm_round_trip_is_bitwise(tmp_path):
    dg = _real_deep_gemm()
    a, b, d, layout = _contiguous_inputs()
    assert a[1].stride() == (1, (a[1].shape[0] + 3) // 4 * 4)
    try:
        dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d.clone(), layout)  # warm-up JIT, validity
    except Exception as exc:
        pytest.skip(f"this deep_gemm build rejects the SM90 inputs: {type(exc).__name__}: {exc}")
    torch.cuda.synchronize()
    with kdump.recording("deep_gemm", out=tmp_path) as rec:
        dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout)
    torch.cuda.synchronize()
    (path,) = rec.written
    call = load_bundle(path).calls[0]
    assert call.target == "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
    assert torch.equal(call.outputs["d"], d.cpu())
    assert call.meta["stream"] == torch.cuda.current_stream().cuda_stream
    assert "deep_gemm" in load_bundle(path).env["libraries"]
    mat = call.materialize("cuda")
    assert mat.args[0][1].stride() == a[1].stride()
    assert mat.args[2].data_ptr() % 1024 == d.data_ptr() % 1024
    dg.m_grouped_fp8_gemm_nt_contiguous(*mat.args, **mat.kwargs)
    torch.cuda.synchronize()
    replayed = mat.args[2].cpu()
    recorded = call.outputs["d"]
    mismatch = (replayed.view(torch.int16) != recorded.view(torch.int16)).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at {mismatch[0].tolist()}"


def test_cuda_call_and_graph_capture_metadata_only(tmp_path):
    sys.path.insert(0, str(STANDINS))
    try:
        import plainmod

        x = torch.randn(1024, device="cuda")
        y = torch.randn(1024, device="cuda")
        y0 = y.clone()
        with kdump.recording("plainmod:axpy", out=tmp_path, outputs="all") as rec:
            plainmod.axpy(0.5, x, y)  # eager: full data
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(s), torch.cuda.graph(graph):
                plainmod.axpy(0.5, x, y)  # captured: metadata only, no sync
        graph.replay()
        torch.cuda.synchronize()
        eager, captured = (load_bundle(p).calls[0] for p in rec.written)
        assert torch.equal(eager.args[2], y0.cpu())
        assert eager.meta["capturing"] is False
        env = load_bundle(rec.written[0]).env  # a CUDA call: the GPU facts are collected
        assert env["cuda_available"] is True and env["sm_count"] > 0 and env["gpu_name"]
        assert captured.meta["capturing"] is True and captured.meta["data"] == "metadata-only"
        ptrs = [t["data_ptr"] for t in captured.meta["tensors_metadata"]["tensors"]]
        assert ptrs == [x.data_ptr(), y.data_ptr()]
    finally:
        sys.path.remove(str(STANDINS))
        sys.modules.pop("plainmod", None)
