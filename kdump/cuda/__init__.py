"""The CUDA toolchain kdump's own kernels and its sanitizer mode share: NVRTC and the CUDA headers
(`nvrtc`), and the external tools a replay may call (`tools`: compute-sanitizer, disassemblers)."""
