"""One small packaged-kernel call per layout, synchronised: fails fast (instead of hanging a long
test run) when a kernel change deadlocks or faults. Run under `timeout`."""

import torch

from kdump.kernels import sm120

FP8 = torch.float8_e4m3fn
g, n, k = 4, 256, 512
labels = torch.full((g, 128), -1, dtype=torch.int32)
for e, c in enumerate((1, 0, 77, 128)):
    labels[e, :c] = e
labels = labels.flatten().cuda()
m = labels.numel()
a = torch.randn(m, k, device="cuda").to(FP8)
b = torch.randn(g, n, k, device="cuda").to(FP8)
sfa = torch.ones(k // 128, m, device="cuda").T
sfb = torch.ones(g, n // 128, k // 128, device="cuda")
d = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
sm120.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, labels)
torch.cuda.synchronize()
ref = a[:1].float() @ b[0].float().T
print("smoke ok, row 0 max err", (d[:1].float() - ref).abs().max().item())
