"""A small MoE decode loop, the way sglang's decode runs DeepGEMM's grouped GEMM.

router -> top-k -> per-expert contiguous layout (every expert padded to 128 rows) -> grouped GEMM
w13 -> SiLU-and-mul -> FP8 quantisation -> grouped GEMM w2. On CUDA the expert part is captured
as one CUDA graph per batch-size tier after an eager warm-up, and every step writes the new
routing and activations IN PLACE into the graph's buffers and replays it. Each step's output is
checked against the torch reference; a mismatch raises (exit 1).

Backends: deep_gemm (the installed DeepGEMM), packaged (kdump's packaged kernel), faulty (its
fault variant with a planted stale-schedule bug), reference (torch; CPU too, without graphs).

The fault variant plans its tile schedule on the first call per buffer pair and reuses it: a
graph replay whose routing activates more 128-row tiles than the warm-up did writes D rows past
the end of d (out of bounds) and computes stale experts, so this loop raises a mismatch at the
first such step, or dies of an illegal address. `kdump replay` of the salvaged bundle of that
replay (graph mode by default) reproduces it: exit 4 (stray writes caught by the guard bytes
around d) or 1 (wrong values) when the extra tiles stay inside d.

    kdump record -- python examples/moe_decode.py --backend faulty
    kdump replay kdump-out/flight.*/journal-*-call-*.kdump

MOE_DECODE_FED=FOLDER: every step saves what it fed the w13 GEMM (a, sfa, labels) to
FOLDER/step-N.pt before running it (for checking salvaged bundles bitwise).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

TARGET = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
ROWS = 128  # DeepGEMM's M alignment: every expert owns a 128-row block


def gemm_backend(name: str) -> Callable[..., None]:
    """The grouped GEMM, looked up on its module at every call (as sglang calls DeepGEMM), so a
    recorder that patches the module's attribute sees each call."""
    if name == "reference":
        return reference_gemm
    modules = {
        "deep_gemm": "deep_gemm",
        "packaged": "kdump.kernels.sm120.api",
        "faulty": "kdump.kernels.sm120.faulty",
    }
    if name not in modules:
        raise SystemExit(f"unknown backend {name!r}: use deep_gemm, packaged, faulty or reference")
    module = importlib.import_module(modules[name])

    def gemm(*args: Any, **kwargs: Any) -> None:
        module.m_grouped_fp8_gemm_nt_contiguous(*args, **kwargs)

    return gemm


def reference_gemm(a: Any, b: Any, d: torch.Tensor, grouped_layout: torch.Tensor, **_: Any) -> None:
    from kdump.kernels import registry

    spec = registry.spec_for(TARGET)
    bound = spec.bind((a, b, d, grouped_layout), {})
    want = spec.reference(bound)["d"]
    mask = spec.meaningful(bound, "d")
    d.copy_(torch.where(mask, want, d))


class Experts:
    """FP8 expert weights with 128x128 block scales (static operands)."""

    def __init__(self, e: int, hidden: int, inter: int, gen: torch.Generator, device: str) -> None:
        from kdump.kernels.deepgemm.generators import quantize_per_block

        w13 = torch.randn(e, 2 * inter, hidden, generator=gen) * 0.05
        w2 = torch.randn(e, hidden, inter, generator=gen) * 0.05
        q13, s13 = quantize_per_block(w13)
        q2, s2 = quantize_per_block(w2)
        self.w13 = (q13.to(device), s13.to(device))
        self.w2 = (q2.to(device), s2.to(device))


class Tier:
    """One batch-size tier: the graph's static buffers, written in place every step."""

    def __init__(self, e: int, hidden: int, inter: int, device: str) -> None:
        from kdump.kernels.deepgemm.scales import to_mn_major

        m = e * ROWS
        kw = {"device": device}
        self.a = torch.zeros(m, hidden, dtype=torch.float8_e4m3fn, **kw)
        # Scales MN-major and TMA-aligned, as DeepGEMM takes them (copy_ keeps the strides).
        self.sfa = to_mn_major(torch.ones(m, hidden // 128, dtype=torch.float32, **kw))
        self.labels = torch.full((m,), -1, dtype=torch.int32, **kw)
        self.d1 = torch.zeros(m, 2 * inter, dtype=torch.bfloat16, **kw)
        self.a2 = torch.zeros(m, inter, dtype=torch.float8_e4m3fn, **kw)
        self.sfa2 = to_mn_major(torch.ones(m, inter // 128, dtype=torch.float32, **kw))
        self.d2 = torch.zeros(m, hidden, dtype=torch.bfloat16, **kw)
        self.graph: torch.cuda.CUDAGraph | None = None


def experts_forward(t: Tier, w: Experts, gemm: Callable[..., None]) -> None:
    """What the graph holds: GEMM w13, SiLU-and-mul, quantise, GEMM w2 (all in place)."""
    from kdump.kernels.deepgemm.generators import quantize_per_token

    gemm((t.a, t.sfa), w.w13, t.d1, t.labels)
    inter = t.d1.shape[1] // 2
    h = torch.nn.functional.silu(t.d1[:, :inter].float()) * t.d1[:, inter:].float()
    q, sf = quantize_per_token(h)
    t.a2.copy_(q)
    t.sfa2.copy_(sf)
    gemm((t.a2, t.sfa2), w.w2, t.d2, t.labels)


def route(x: torch.Tensor, router: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = x.float() @ router
    weights, experts = torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    return weights, experts


def fill_tier(t: Tier, x: torch.Tensor, experts: torch.Tensor) -> list[tuple[int, int, int]]:
    """Write this step's tokens into the tier's buffers in place; (token, k, row) per slot."""
    from kdump.kernels.deepgemm.generators import quantize_per_token

    e = t.labels.shape[0] // ROWS
    labels = torch.full_like(t.labels, -1)
    rows_x = torch.zeros(t.a.shape, dtype=torch.float32, device=x.device)
    used = [0] * e
    slots = []
    for tok, ks in enumerate(experts.tolist()):
        for k, ex in enumerate(ks):
            row = ex * ROWS + used[ex]
            used[ex] += 1
            labels[row] = ex
            rows_x[row] = x[tok].float()
            slots.append((tok, k, row))
    q, sf = quantize_per_token(rows_x)
    t.a.copy_(q)
    t.sfa.copy_(sf)
    t.labels.copy_(labels)
    return slots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="packaged")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tiers", default="4,16", help="batch sizes with a graph each")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    gen = torch.Generator().manual_seed(args.seed)
    dev = args.device
    graphs = dev.startswith("cuda")
    gemm = gemm_backend(args.backend)
    w = Experts(args.experts, args.hidden, args.inter, gen, dev)
    router = (torch.randn(args.hidden, args.experts, generator=gen)).to(dev)
    sizes = [int(bs) for bs in args.tiers.split(",")]
    tiers = {bs: Tier(args.experts, args.hidden, args.inter, dev) for bs in sizes}
    fed_dir = os.environ.get("MOE_DECODE_FED")

    # Warm-up (eager) and capture, per tier. Warm-up routes every token to expert 0, so the
    # capture-time schedule has few active tiles (what exposes the fault variant's stale plan).
    for bs, t in tiers.items():
        x = torch.randn(bs, args.hidden, generator=gen).to(dev)
        fill_tier(t, x, torch.zeros(bs, 1, dtype=torch.int64))
        experts_forward(t, w, gemm)
        if graphs:
            torch.cuda.synchronize()
            t.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(t.graph):
                experts_forward(t, w, gemm)

    for step in range(args.steps):
        bs = list(tiers)[step % len(tiers)]
        t = tiers[bs]
        x = torch.randn(bs, args.hidden, generator=gen).to(dev)
        weights, experts = route(x, router, args.topk)
        slots = fill_tier(t, x, experts.cpu())
        if fed_dir:
            torch.save(
                {"a": t.a.cpu(), "sfa": t.sfa.cpu(), "labels": t.labels.cpu(), "tier": bs},
                os.path.join(fed_dir, f"step-{step}.pt"),
            )
        want = Tier(args.experts, args.hidden, args.inter, dev)
        for name in ("a", "sfa", "labels"):
            getattr(want, name).copy_(getattr(t, name))
        if t.graph is not None:
            t.graph.replay()
        else:
            experts_forward(t, w, gemm)
        experts_forward(want, w, reference_gemm)
        rows = torch.tensor([r for _, _, r in slots], device=dev)
        got, ref = t.d2[rows].float(), want.d2[rows].float()
        bad = ~torch.isclose(got, ref, atol=2e-2, rtol=5e-2)
        if bool(bad.any()):
            n = int(bad.sum())
            raise RuntimeError(
                f"step {step} (tier {bs}): {n} of {bad.numel()} output values differ from the "
                f"reference (max |diff| {float((got - ref).abs().max()):.3g})"
            )
        y = torch.zeros(bs, args.hidden, device=dev)
        for tok, k, row in slots:
            y[tok] += weights[tok, k].float() * t.d2[row].float()
        print(f"step {step} tier {bs}: ok (|y| {float(y.norm()):.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
