"""kdump's packaged SM120-class m-grouped FP8 GEMM (CUDA source + NVRTC build + launch).

Importing this package needs neither a GPU nor cuda-python; building and launching do.
"""

from .api import (
    StaleScheduleContiguous,
    is_available,
    m_grouped_fp8_fp4_gemm_nt_contiguous,
    m_grouped_fp8_fp4_gemm_nt_masked,
    m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
    make_faulty_contiguous,
)
from .build import PackagedKernelError

__all__ = [
    "PackagedKernelError",
    "StaleScheduleContiguous",
    "is_available",
    "m_grouped_fp8_fp4_gemm_nt_contiguous",
    "m_grouped_fp8_fp4_gemm_nt_masked",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "make_faulty_contiguous",
]
