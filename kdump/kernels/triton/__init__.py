"""Triton kernels as kdump targets: what a launch is (`launch`), how it is replayed."""
