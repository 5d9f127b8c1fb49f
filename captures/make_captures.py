"""Write the sample bundles in captures/ (synthetic calls whose recorded output is the reference).

    /work/venv/bin/python captures/make_captures.py [OUTDIR]

Inputs come from the spec generators with fixed seeds and fixed per-group row counts (so the data
is identical on every run; the manifest's timestamps and host differ). Each call's recorded output
is the torch reference written into the valid rows of `d`; rows the kernel does not own keep the
NaN that `d` was filled with before capture, as a kernel that skips padding (SM120) leaves them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kdump import envinfo
from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls
from kdump.kernels.deepgemm.specs import MGroupedFP8NTContiguous, MGroupedFP8NTMasked
from kdump.kernels.registry import spec_for

MAX_BYTES = 5 * 1000 * 1000  # per bundle
SMALL = {"n": 256, "k": 512}


@dataclass(frozen=True)
class Sample:
    filename: str
    target: str
    seed: int
    shape: dict[str, Any]
    about: str
    reuse_weights_of: str | None = None  # same B as that sample (a later call of one layer)
    extra: dict[str, Any] = field(default_factory=dict)


CONTIGUOUS = MGroupedFP8NTContiguous.id
MASKED = MGroupedFP8NTMasked.id

SAMPLES: tuple[Sample, ...] = (
    Sample(
        "contiguous_ue8m0.kdump",
        CONTIGUOUS,
        seed=11,
        shape=dict(SMALL, num_groups=6, group_sizes=[37, 100, 0, 64, 16, 91], scale_format="ue8m0"),
        about="m-grouped contiguous FP8 NT, packed UE8M0 scales (SM100/SM120 format), one empty "
        "group, -1 padding to 128 rows per group (M = 640)",
    ),
    Sample(
        "contiguous_ue8m0_b.kdump",
        CONTIGUOUS,
        seed=12,
        shape=dict(SMALL, num_groups=6, group_sizes=[0, 12, 128, 77, 5, 99], scale_format="ue8m0"),
        about="the same layer later: identical shapes and weights as contiguous_ue8m0.kdump, "
        "another per-expert distribution (for graph replays with --then)",
        reuse_weights_of="contiguous_ue8m0.kdump",
    ),
    Sample(
        "contiguous_fp32.kdump",
        CONTIGUOUS,
        seed=21,
        shape=dict(
            SMALL, num_groups=8, group_sizes=[40, 33, 0, 52, 28, 47, 16, 45], scale_format="fp32"
        ),
        about="m-grouped contiguous FP8 NT, SM90 float32 scales (A per token per 128-K block, "
        "MN-major TMA-aligned; B per 128x128 block), one empty group (M = 896)",
    ),
    Sample(
        "masked_ue8m0.kdump",
        MASKED,
        seed=31,
        shape=dict(
            SMALL,
            num_groups=6,
            group_sizes=[24, 0, 64, 17, 100, 51],
            max_m=128,
            expected_m=48,
            scale_format="ue8m0",
        ),
        about="m-grouped masked FP8 NT, packed UE8M0 scales, max_m = 128, one group with "
        "masked_m = 0",
    ),
    Sample(
        "contiguous_psum_fp32.kdump",
        CONTIGUOUS,
        seed=41,
        shape=dict(
            SMALL,
            num_groups=6,
            group_sizes=[29, 0, 77, 128, 3, 60],
            scale_format="fp32",
            use_psum_layout=True,
        ),
        about="m-grouped contiguous FP8 NT with use_psum_layout=True: grouped_layout holds "
        "cumulative end offsets, group g in rows [align(end[g-1], 128), end[g]); float32 scales",
    ),
)


def _mark_skipped_rows(spec: Any, bound: dict[str, Any], ref: torch.Tensor) -> torch.Tensor:
    mask = spec.meaningful(bound, "d")
    return torch.where(mask, ref, bound["d"])


def make(outdir: Path) -> list[Path]:
    outdir.mkdir(parents=True, exist_ok=True)
    env = envinfo.collect(include_gpu=False)
    weights: dict[str, Any] = {}
    written = []
    for s in SAMPLES:
        spec = spec_for(s.target)
        args, kwargs = spec.generate(seed=s.seed, device="cpu", d_fill=float("nan"), **s.shape)
        if s.reuse_weights_of is not None:
            args[1] = weights[s.reuse_weights_of]
        weights[s.filename] = args[1]
        bound = spec.bind(args, kwargs)
        problems = spec.validate(bound)
        if problems:
            raise SystemExit(f"{s.filename}: generated call is invalid: {problems[0]}")
        names = spec.param_names()[: len(args)]
        meta = {
            "synthetic": True,
            "output": "reference",
            "note": "synthetic, reference output",
            "about": s.about,
            "seed": s.seed,
            "generator": {k: v for k, v in s.shape.items()},
        }
        if s.reuse_weights_of:
            meta["weights_from"] = s.reuse_weights_of
        call = capture_call(spec.id, args, kwargs, called_as=spec.id, names=names, meta=meta)
        ref = spec.reference(bound)["d"]
        d = bound["d"]
        d.copy_(_mark_skipped_rows(spec, bound, ref))
        live = input_tensors(call, args, kwargs)
        d_index = next(i for i, t in enumerate(live) if t is d)
        attach_outputs(call, live, [d_index])
        info = {"synthetic": True, "made_by": "captures/make_captures.py", "about": s.about}
        path = save_calls(outdir / s.filename, [call], env=env, info=info)
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise SystemExit(f"{path}: {size} bytes, over the {MAX_BYTES}-byte budget")
        written.append(path)
        print(f"{path}  {size / 1e6:.2f} MB  {s.about}")
    return written


def main(argv: list[str]) -> int:
    outdir = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent
    make(outdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
