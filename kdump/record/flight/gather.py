"""Row gathers of the flight recorder's device tier: plans, their semantics, and the fused kernel.

A plan says, for one call signature, which tensors are gathered by rows (A and its scales), the
row rule (kdump.kernels.plugin.Touch) and the record layout in a device ring slot: one record per
touched row, `[u32 row, 12 zero bytes]` then each gathered tensor's bytes of that row at a
16-byte aligned offset. `reference_gather` is the plain-torch meaning of the kernel (tests compare
the two bit for bit) and `place_back` its inverse, used by salvage.

The kernel (snapshot.cu) is compiled with NVRTC for the device's arch and cached on disk like the
packaged GEMM (the toolchain in kdump.cuda.nvrtc), with its constants passed from here as -D flags
(DEFINES: the one place they are written); it is launched with cuLaunchKernel on the current
torch stream with its descriptor table passed by value, so a capture freezes it into the graph
node.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kdump import config
from kdump.errors import InternalError
from kdump.format.journal import CALL_RECORD_BYTES

SOURCE_NAME = "snapshot.cu"
KERNEL = "kd_snapshot"
MARK_KERNEL = "kd_mark"
MARKS_KERNEL = "kd_marks"

# The kernel's constants. snapshot.cu defines none of them: DEFINES passes each as a -D flag, and
# the host sizes its grids, buffers and descriptor tables from the same names.
MAX_MARKS = 32  # the `post` markers one kd_marks launch writes
MAX_COPIES = 16  # plain byte ranges in one launch's descriptor table
MAX_GATHERS = 4  # row gathers sharing one compaction
# Rows of a window: fewer windows cost fewer counter round trips; smaller ones spread uneven
# routing over the SMs (H200: 128 beat 64 and 256 at 1-32 tokens per expert, 64 was 6 % faster
# with A rows at 113).
ROWS_PER_BLOCK = 128
THREADS = 256
UNROLL = 4  # loads in flight per thread before its stores
COPY_CHUNK = THREADS * 16 * UNROLL  # bytes of a plain copy per block step
MAX_COPY_BLOCKS = 1024  # blocks taking the plain copies' chunks at most
MAX_GRID = (1 << 31) - 1 - MAX_COPY_BLOCKS  # the grid's x limit, less the plain copies' blocks
# A window's touched rows are shared among up to Params.split units of work, each reserving its
# own records: the host picks split so that a unit copies at most about SPLIT_BYTES when every row
# is touched (gather_grid), and launches about as many gather blocks as the GPU holds at once,
# each taking units round robin. One block per window left a big gather in a wave and a tail of
# large blocks; one block per unit made sparse routing pay a wave of idle blocks per unit of
# split. (A split chosen to fill the waves instead, fewer and larger units where the units would
# have made the busiest blocks copy two while most copied one, measured slower on the H100:
# 256 MB 0.86x against 0.88x, decode 32 / A+scales 43.2 against 41.6 us.) H100 (2026-12-06),
# with MIN_BLOCKS 3: 131072 against 65536 the same on big gathers and 1-6 us faster at every
# decode shape (fewer rounds of UNITS). Host only: the kernel reads Params.split.
SPLIT_BYTES = 131072
UNITS = 8  # units a gather block tests the rule of at once (one round trip for them)
# Blocks an SM should hold at once (__launch_bounds__' register cap): 3 against the 2 that 256
# threads held without it, H100: 0.5-1.2 us faster at every decode shape, big gathers within
# 0.03x. SMs with about 100 KiB of shared memory (sm_86/89, sm_120) fit only 2 blocks of the
# buffer's 32 KiB and more, so there the cap would only spill (sm_120a, by ptxas: 88 bytes of
# spill stores at 3, none at 2): the kernel takes MIN_BLOCKS_SMALL_SMEM there.
MIN_BLOCKS = 3
MIN_BLOCKS_SMALL_SMEM = 2
STAGE_WORDS = 4096  # shared-memory words staging a block's strided 4-byte rows
# Loads in flight per thread in the staged gather (H200: 8 and 16 were 1.3-3.7 us slower at every
# decode shape).
STAGE_UNROLL = 4
# The bulk gather (sm_90+): BULK_WARPS issuing threads, each with BULK_STAGES buffers of
# BULK_STAGE bytes (a multiple of 16).
BULK_WARPS = 4
BULK_STAGES = 4
BULK_STAGE = 2048
# Pieces in flight per issuer when a call's rows and its strided scales are gathered side by side
# (the rest of the buffer stages the scales).
OVERLAP_STAGES = 3
# The dynamic shared memory buffer in 4-byte words: the larger of the bulk gather's stages and
# the staged gather's words.
BUF_WORDS = max(BULK_WARPS * BULK_STAGES * BULK_STAGE // 4, STAGE_WORDS)
RULES = {"all": 0, "labels": 1, "masked": 2, "psum": 3}
RECORD_HEAD = 16  # u32 row index, 12 zero bytes
# A device ring slot's header (snapshot.cu's SlotHead, sized by -D): the call record's fields.
SLOT_HEADER = struct.Struct("<IIQQQIIQQQ")
SLOT_HEAD = SLOT_HEADER.size  # 64
CALL_RECORD = CALL_RECORD_BYTES  # Record in snapshot.cu (kdump.format.journal's layout)
SLOT_MAGIC = 0x5352444B  # "KDRS": a device ring slot header
RECORD_MAGIC = 0x5244444B  # "KDDR": the call record in the twin
SLOT_ALIGN = 256


class SnapshotSourceError(InternalError):
    """kdump's snapshot kernel does not compile: a bug in kdump, not in this machine."""


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class RowGather:
    """One tensor gathered by rows. Byte strides; `src_offset` is the byte offset of its element
    [0, 0, ...] from its storage's span start."""

    tensor: int  # index in the call's tensor table
    storage: int
    src_offset: int
    outer_stride: int
    inner_stride: int
    col_stride: int
    cols: int
    elem: int
    rec_off: int

    @property
    def row_bytes(self) -> int:
        return self.cols * self.elem


@dataclass(frozen=True)
class Plan:
    """The gathers of one call signature (shapes, strides, dtypes)."""

    rule: str
    rule_tensor: int | None  # tensor index of the rule's int32 values
    rows: int
    inner: int
    alignment: int
    gathers: tuple[RowGather, ...]
    rec_bytes: int

    @property
    def worst(self) -> int:
        """Bytes of a slot when every row is touched."""
        return _round_up(SLOT_HEAD + self.rows * self.rec_bytes, SLOT_ALIGN)

    @property
    def storages(self) -> frozenset[int]:
        return frozenset(g.storage for g in self.gathers)

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "rule_tensor": self.rule_tensor,
            "rows": self.rows,
            "inner": self.inner,
            "alignment": self.alignment,
            "rec_bytes": self.rec_bytes,
            "gathers": [
                {
                    "tensor": g.tensor,
                    "storage": g.storage,
                    "src_offset": g.src_offset,
                    "outer_stride": g.outer_stride,
                    "inner_stride": g.inner_stride,
                    "col_stride": g.col_stride,
                    "cols": g.cols,
                    "elem": g.elem,
                    "rec_off": g.rec_off,
                }
                for g in self.gathers
            ],
        }

    @classmethod
    def from_json(cls, d: Any) -> Plan:
        """Strict: a damaged description raises ValueError (salvage then marks it missing)."""
        if not isinstance(d, dict) or d.get("rule") not in RULES:
            raise ValueError("device gather plan is malformed")

        def num(x: Any, lo: int = 0) -> int:
            if not isinstance(x, int) or isinstance(x, bool) or x < lo:
                raise ValueError("device gather plan holds a bad number")
            return x

        gathers = d.get("gathers")
        if not isinstance(gathers, list) or not 0 < len(gathers) <= MAX_GATHERS:
            raise ValueError("device gather plan has no gathers")
        rt = d.get("rule_tensor")
        plan = cls(
            rule=d["rule"],
            rule_tensor=None if rt is None else num(rt),
            rows=num(d.get("rows")),
            inner=num(d.get("inner"), 1),
            alignment=num(d.get("alignment"), 1),
            rec_bytes=num(d.get("rec_bytes"), RECORD_HEAD),
            gathers=tuple(
                RowGather(
                    **{
                        k: num(g.get(k))
                        for k in (
                            "tensor",
                            "storage",
                            "src_offset",
                            "outer_stride",
                            "inner_stride",
                            "col_stride",
                            "cols",
                            "elem",
                            "rec_off",
                        )
                    }
                )
                if isinstance(g, dict)
                else _bad()
                for g in gathers
            ),
        )
        for g in plan.gathers:
            if g.rec_off < RECORD_HEAD or g.rec_off + g.row_bytes > plan.rec_bytes:
                raise ValueError("device gather plan: a row lies outside its record")
        return plan


def _bad() -> Any:
    raise ValueError("device gather plan: a gather is not an object")


def make_plan(
    tensors: Sequence[Any],
    records: Sequence[Any],
    storages: Sequence[Any],
    gathered: Sequence[int],
    rule: str,
    rule_tensor: int | None,
    row_dims: int,
    alignment: int = 1,
) -> Plan | None:
    """The plan gathering tensors `gathered` (indices into `tensors`, which share their first
    `row_dims` dimensions) by `rule`; None when their layouts do not allow it (then they are
    copied whole or left out)."""
    if rule not in RULES or not gathered or len(gathered) > MAX_GATHERS or row_dims not in (1, 2):
        return None
    lead = tuple(tensors[gathered[0]].shape[:row_dims])
    if len(lead) != row_dims:
        return None
    rows = 1
    for n in lead:
        rows *= int(n)
    inner = int(lead[-1])
    if rows == 0 or inner == 0 or rows >= 1 << 31:
        return None
    out: list[RowGather] = []
    off = RECORD_HEAD
    for ti in gathered:
        t = tensors[ti]
        if tuple(t.shape[:row_dims]) != lead or t.dim() < row_dims:
            return None
        isz = t.element_size()
        st = [int(s) * isz for s in t.stride()]
        rest = [(int(n), s) for n, s in zip(t.shape[row_dims:], st[row_dims:]) if int(n) != 1]
        if not rest:
            cols, col_stride, elem = 1, isz, isz
        elif len(rest) == 1:
            cols, col_stride = rest[0]
            elem = isz
            if col_stride == isz:  # a contiguous row: one element of the whole row
                cols, elem = 1, cols * isz
        else:
            return None
        r = records[ti]
        s = storages[r.storage]
        outer_stride = st[0] if row_dims == 2 else 0
        inner_stride = st[row_dims - 1]
        out.append(
            RowGather(
                tensor=ti,
                storage=r.storage,
                src_offset=r.storage_offset * isz - s.span_start,
                outer_stride=outer_stride,
                inner_stride=inner_stride,
                col_stride=col_stride,
                cols=cols,
                elem=elem,
                rec_off=off,
            )
        )
        off = _round_up(off + cols * elem, 16)
    return Plan(rule, rule_tensor, rows, inner, max(1, alignment), tuple(out), off)


# ---------------------------------------------------------------------------------------------
# The semantics in plain torch (CPU or GPU).


def touched_rows(rule: str, values: Any, rows: int, inner: int, alignment: int = 1) -> Any:
    """Bool [rows]: the rows a call can read under `rule` (values: the rule's int32 tensor)."""
    import torch

    if rule == "all":
        return torch.ones(rows, dtype=torch.bool)
    v = values.reshape(-1).to("cpu", torch.int64)
    r = torch.arange(rows, dtype=torch.int64)
    if rule == "labels":
        ok = torch.zeros(rows, dtype=torch.bool)
        n = min(rows, v.numel())
        ok[:n] = v[:n] >= 0
        return ok
    if rule == "masked":
        g = r // inner
        inside = g < v.numel()
        counts = torch.zeros(rows, dtype=torch.int64)
        counts[inside] = v[g[inside]]
        return inside & ((r % inner) < counts)
    if rule == "psum":
        ends = v
        grp = torch.searchsorted(ends, r, right=True)
        inside = grp < ends.numel()
        prev = torch.zeros(rows, dtype=torch.int64)
        has_prev = inside & (grp > 0)
        prev[has_prev] = ends[grp[has_prev] - 1]
        a = max(1, alignment)
        start = torch.where(grp > 0, (prev + a - 1) // a * a, torch.zeros_like(prev))
        return inside & (r >= start)
    raise ValueError(f"unknown row rule {rule!r}")


def _row_view(g: RowGather, span: Any, rows: int, inner: int) -> Any:
    """uint8 [rows, cols, elem] over a storage span's bytes."""
    outer = rows // inner
    return span.as_strided(
        (outer, inner, g.cols, g.elem),
        (g.outer_stride, g.inner_stride, g.col_stride, 1),
        g.src_offset,
    ).reshape(rows, g.cols, g.elem)


def reference_gather(plan: Plan, spans: Sequence[Any], rule_values: Any) -> tuple[Any, Any]:
    """(row indices int64 [n], records uint8 [n, rec_bytes]) in row order: what the kernel
    writes after its slot header (the kernel may order blocks differently; records are matched
    by their row index)."""
    import torch

    ok = touched_rows(plan.rule, rule_values, plan.rows, plan.inner, plan.alignment)
    idx = torch.nonzero(ok).reshape(-1)
    recs = torch.zeros(idx.numel(), plan.rec_bytes, dtype=torch.uint8)
    recs[:, 0:4] = idx.to(torch.int32).view(-1, 1).view(torch.uint8).reshape(-1, 4)
    for g in plan.gathers:
        rows = _row_view(g, spans[g.storage].cpu(), plan.rows, plan.inner)
        recs[:, g.rec_off : g.rec_off + g.row_bytes] = rows[idx].reshape(idx.numel(), g.row_bytes)
    return idx, recs


def place_back(plan: Plan, records: Any, spans: dict[int, Any]) -> Any:
    """Scatter records (uint8 [n, rec_bytes]) into zero-filled storage spans (uint8 tensors,
    written in place); returns the row indices placed. Raises ValueError on rows out of range."""
    import torch

    if records.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    idx = records[:, 0:4].contiguous().view(torch.int32).reshape(-1).to(torch.int64)
    if int(idx.min()) < 0 or int(idx.max()) >= plan.rows:
        raise ValueError("a device ring record names a row outside the tensor")
    for g in plan.gathers:
        rows = _row_view(g, spans[g.storage], plan.rows, plan.inner)
        rows[idx] = records[:, g.rec_off : g.rec_off + g.row_bytes].reshape(-1, g.cols, g.elem)
    return idx


def held_ranges(plan: Plan, idx: Any, limit: int) -> dict[int, list[tuple[int, int]]] | None:
    """Per gathered storage, the span-relative byte ranges rows `idx` (int64) occupy: sorted,
    disjoint, adjacent ones merged. None when some storage would need more than `limit`."""
    import torch

    out: dict[int, list[tuple[int, int]]] = {}
    starts_of: dict[int, list[Any]] = {}
    lens_of: dict[int, list[Any]] = {}
    outer, inner = idx // plan.inner, idx % plan.inner
    for g in plan.gathers:
        row0 = g.src_offset + outer * g.outer_stride + inner * g.inner_stride
        if g.cols == 1 or g.col_stride == g.elem:  # a row is one run of bytes
            starts, n = row0, g.row_bytes
        else:
            cols = torch.arange(g.cols, dtype=torch.int64) * g.col_stride
            starts, n = (row0.view(-1, 1) + cols.view(1, -1)).reshape(-1), g.elem
        starts_of.setdefault(g.storage, []).append(starts)
        lens_of.setdefault(g.storage, []).append(torch.full_like(starts, n))
    for storage in starts_of:
        starts = torch.cat(starts_of[storage])
        ends = starts + torch.cat(lens_of[storage])
        order = torch.argsort(starts)
        starts, ends = starts[order], ends[order]
        if starts.numel() == 0:
            out[storage] = []
            continue
        # A run ends where the next start lies past every end so far (overlaps merge too).
        reach = torch.cummax(ends, 0).values
        new = torch.ones_like(starts, dtype=torch.bool)
        new[1:] = starts[1:] > reach[:-1]
        first = torch.nonzero(new).reshape(-1)
        if first.numel() > limit:
            return None
        last = torch.cat([first[1:] - 1, torch.tensor([starts.numel() - 1])])
        out[storage] = list(zip(starts[first].tolist(), reach[last].tolist()))
    return out


def sort_records(records: Any) -> Any:
    """Records in row order (the kernel's blocks finish in any order)."""
    import torch

    if records.numel() == 0:
        return records
    idx = records[:, 0:4].contiguous().view(torch.int32).reshape(-1)
    return records[torch.argsort(idx.to(torch.int64))]


# ---------------------------------------------------------------------------------------------
# The kernel: build, load, launch.


class _Copy(ctypes.Structure):
    _fields_ = [("src", ctypes.c_uint64), ("dst", ctypes.c_uint64), ("nbytes", ctypes.c_uint64)]


class _Gather(ctypes.Structure):
    _fields_ = [
        ("src", ctypes.c_uint64),
        ("outer_stride", ctypes.c_int64),
        ("inner_stride", ctypes.c_int64),
        ("col_stride", ctypes.c_int64),
        ("cols", ctypes.c_uint32),
        ("elem", ctypes.c_uint32),
        ("rec_off", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class SnapParams(ctypes.Structure):
    """Mirror of Params in snapshot.cu (same order, same types)."""

    _fields_ = [
        ("copies", _Copy * MAX_COPIES),
        ("gathers", _Gather * MAX_GATHERS),
        ("rule", ctypes.c_uint64),
        ("ctrl", ctypes.c_uint64),
        ("ring", ctypes.c_uint64),
        ("ring_bytes", ctypes.c_uint64),
        ("worst", ctypes.c_uint64),
        ("token_ptr", ctypes.c_uint64),
        ("record", ctypes.c_uint64),
        ("host_pre", ctypes.c_uint64),
        ("seq", ctypes.c_uint64),
        ("call_index", ctypes.c_uint64),
        ("chain", ctypes.c_uint64),
        ("host_done", ctypes.c_uint64),
        ("n_copies", ctypes.c_uint32),
        ("n_gathers", ctypes.c_uint32),
        ("rule_kind", ctypes.c_uint32),
        ("rule_n", ctypes.c_uint32),
        ("rows", ctypes.c_uint32),
        ("inner", ctypes.c_uint32),
        ("alignment", ctypes.c_uint32),
        ("rec_bytes", ctypes.c_uint32),
        ("slot_index", ctypes.c_uint32),
        ("gather_blocks", ctypes.c_uint32),
        ("split", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class Marks(ctypes.Structure):
    """Mirror of Marks in snapshot.cu: n words, each copied from src[k] to dst[k]."""

    _fields_ = [
        ("n", ctypes.c_uint64),
        ("src", ctypes.c_uint64 * MAX_MARKS),
        ("dst", ctypes.c_uint64 * MAX_MARKS),
    ]


class Kernels(NamedTuple):
    """The snapshot module's functions on one device (`get_kernel`)."""

    snapshot: Any
    module: Any
    seconds: float  # what building and loading it took
    mark: Any  # kd_mark: one done marker
    marks: Any  # kd_marks: a batch of `post` markers
    smem: int  # dynamic shared memory bytes of every kd_snapshot launch (SMEM_BYTES)
    resident: int  # kd_snapshot blocks the device holds at once (resident_blocks; 0: unknown)


# The -D flags of every build: name -> C literal (the unrolls and the chunk keep the unsigned types
# the kernel's arithmetic was written for).
DEFINES: dict[str, str] = {
    "KD_MAX_COPIES": str(MAX_COPIES),
    "KD_MAX_GATHERS": str(MAX_GATHERS),
    "KD_MAX_MARKS": str(MAX_MARKS),
    "KD_ROWS_PER_BLOCK": str(ROWS_PER_BLOCK),
    "KD_UNITS": str(UNITS),
    "KD_MIN_BLOCKS": str(MIN_BLOCKS),
    "KD_MIN_BLOCKS_SMALL_SMEM": str(MIN_BLOCKS_SMALL_SMEM),
    "KD_THREADS": str(THREADS),
    "KD_UNROLL": f"{UNROLL}u",
    "KD_CHUNK": f"{COPY_CHUNK}ull",
    "KD_STAGE_WORDS": str(STAGE_WORDS),
    "KD_STAGE_UNROLL": f"{STAGE_UNROLL}u",
    "KD_BULK_WARPS": str(BULK_WARPS),
    "KD_BULK_STAGES": str(BULK_STAGES),
    "KD_BULK_STAGE": str(BULK_STAGE),
    "KD_OVERLAP_STAGES": str(OVERLAP_STAGES),
    "KD_BUF_WORDS": str(BUF_WORDS),
    "KD_RULE_LABELS": str(RULES["labels"]),
    "KD_RULE_MASKED": str(RULES["masked"]),
    "KD_RULE_PSUM": str(RULES["psum"]),
    "KD_SLOT_MAGIC": f"{SLOT_MAGIC:#x}u",
    "KD_RECORD_MAGIC": f"{RECORD_MAGIC:#x}u",
    "KD_SLOT_HEAD_BYTES": str(SLOT_HEAD),
    "KD_RECORD_BYTES": str(CALL_RECORD),
    "KD_PARAMS_BYTES": str(ctypes.sizeof(SnapParams)),
    "KD_MARKS_BYTES": str(ctypes.sizeof(Marks)),
}
# Dynamic shared memory of every kd_snapshot launch: its buffer of BUF_WORDS words.
SMEM_BYTES = 4 * BUF_WORDS


def kernel_source() -> str:
    return importlib.resources.files(__package__).joinpath(SOURCE_NAME).read_text(encoding="utf-8")


def define_flags(defines: dict[str, str] = DEFINES) -> list[str]:
    """`defines` as NVRTC's define_macro entries (NAME=VALUE)."""
    return [f"{name}={value}" for name, value in defines.items()]


def gather_grid(
    rows: int,
    rec_bytes: int,
    resident: int = 0,
    rows_per_block: int = ROWS_PER_BLOCK,
    split_bytes: int | None = None,
) -> tuple[int, int]:
    """(gather blocks, units per window) of a gather of `rows` rows of `rec_bytes`-byte records:
    windows of `rows_per_block` rows, each split into as many units as it takes for one unit to
    copy at most about `split_bytes` (default: SPLIT_BYTES) when every row is
    touched (at most one unit per row); as many blocks as units, at most `resident` (the blocks
    the GPU holds at once; 0: no limit), each taking units round robin."""
    windows = -(-rows // rows_per_block)
    if windows == 0:
        return 0, 1
    unit_bytes = max(1, SPLIT_BYTES if split_bytes is None else split_bytes)
    units_needed = -(-rows_per_block * rec_bytes // unit_bytes)
    # at most one unit per row and 2^32 units of work
    split = max(1, min(rows_per_block, units_needed, ((1 << 32) - 1) // windows))
    units = windows * split
    return min(units, resident or units, MAX_GRID), split


def resident_blocks(fn: Any, smem: int, threads: int = THREADS) -> int:
    """How many blocks of kd_snapshot `fn` the current device holds at once (0: unknown)."""
    from kdump.cuda.nvrtc import driver as _driver

    d = _driver()
    try:
        err, per_sm = d.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, smem)
        if err != d.CUresult.CUDA_SUCCESS:
            return 0
        err, dev = d.cuCtxGetDevice()
        if err != d.CUresult.CUDA_SUCCESS:
            return 0
        attr = d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        err, sms = d.cuDeviceGetAttribute(attr, dev)
        if err != d.CUresult.CUDA_SUCCESS:
            return 0
    except Exception:  # an older cuda-bindings: launch one block per unit
        return 0
    return max(0, int(per_sm) * int(sms))


def allow_smem(fn: Any, smem: int) -> None:
    """Let `fn` (a loaded kd_snapshot) launch with `smem` dynamic shared bytes: past 48 KiB with
    its static shared memory the driver wants the function's opt-in first (set always: a value
    under the default limit is valid everywhere)."""
    if smem <= 0:
        return
    from kdump.cuda.nvrtc import check as _check
    from kdump.cuda.nvrtc import driver as _driver

    driver = _driver()
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check(driver.cuFuncSetAttribute(fn, attr, smem), f"cuFuncSetAttribute({KERNEL}, {smem} B)")


def cache_path(arch: str) -> Path:
    from kdump.cuda.nvrtc import nvrtc_version

    root = config.get("KDUMP_CACHE_DIR") or str(Path.home() / ".cache" / "kdump")
    h = hashlib.sha256(kernel_source().encode())
    h.update(repr((arch, nvrtc_version(), define_flags())).encode())
    return Path(root).expanduser() / "snapshot" / f"snapshot-{arch}-{h.hexdigest()[:32]}.cubin"


def build_cubin(arch: str, use_cache: bool = True) -> bytes:
    """Compile (or fetch from the cache) the snapshot kernel for `arch` (e.g. sm_90a)."""
    from kdump.cuda.nvrtc import ToolchainError

    try:
        from cuda.core import Program, ProgramOptions
    except ImportError as exc:
        raise ToolchainError(f"cuda-core is not installed ({exc}): pip install cuda-core") from exc
    path = cache_path(arch)
    if use_cache and path.is_file():
        return path.read_bytes()
    opts = ProgramOptions(
        name=SOURCE_NAME, arch=arch, std="c++17", lineinfo=True, define_macro=define_flags()
    )
    try:
        obj = Program(kernel_source(), "c++", opts).compile("cubin", logs=None)
    except Exception as exc:
        first = str(exc).strip().splitlines()
        raise SnapshotSourceError(
            f"NVRTC failed to compile kdump's {SOURCE_NAME} for {arch}: "
            f"{' | '.join(first[:6]) if first else type(exc).__name__}"
        ) from exc
    cubin = bytes(obj.code)
    if use_cache:
        from kdump.bundle.store import atomic_write

        try:
            atomic_write(path, cubin)
        except OSError:  # a read-only cache only costs a recompile next time
            pass
    return cubin


_functions: dict[int, Kernels] = {}
_lock = threading.Lock()


def arch_of(cc: tuple[int, int]) -> str:
    """The NVRTC arch of a compute capability (the `a` variants where they exist)."""
    major, minor = cc
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def get_kernel(device_index: int) -> Kernels:
    """The snapshot module's functions for a device, built and loaded once per process."""
    import torch

    from kdump.cuda.nvrtc import check as _check
    from kdump.cuda.nvrtc import check_nvrtc_vs_driver
    from kdump.cuda.nvrtc import driver as _driver

    with _lock:
        fn = _functions.get(device_index)
        if fn is not None:
            return fn
        check_nvrtc_vs_driver()
        t0 = time.perf_counter()
        cubin = build_cubin(arch_of(torch.cuda.get_device_capability(device_index)))
        driver = _driver()
        _check(driver.cuInit(0), "cuInit")
        with torch.cuda.device(device_index):
            torch.cuda.current_stream()  # torch's primary context is current from here
            ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
            if not int(ctx):
                dev = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
                ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
            fn = _check(driver.cuModuleGetFunction(module, KERNEL.encode()), f"get {KERNEL}")
            allow_smem(fn, SMEM_BYTES)
            mark, marks = (
                _check(driver.cuModuleGetFunction(module, name.encode()), f"get {name}")
                for name in (MARK_KERNEL, MARKS_KERNEL)
            )
            resident = resident_blocks(fn, SMEM_BYTES)
        k = Kernels(fn, module, time.perf_counter() - t0, mark, marks, SMEM_BYTES, resident)
        _functions[device_index] = k
        return k


def set_plan(
    p: SnapParams, plan: Plan | None, span_ptr: Callable[[int], int], resident: int = 0
) -> None:
    """The kernel arguments that follow from `plan`: its gathers (each read from its storage's
    span at `span_ptr(storage)`), the row rule's kind, the row geometry and the gather's blocks
    (gather_grid, at most `resident`); none without a plan. The rule's values, the ring and the
    control words are the caller's."""
    if plan is None:
        p.n_gathers = p.rule = p.rule_n = p.rule_kind = p.rows = p.gather_blocks = 0
        p.inner = p.alignment = p.split = 1
        p.rec_bytes = p.worst = 0
        return
    for k, g in enumerate(plan.gathers):
        d = p.gathers[k]
        d.src = span_ptr(g.storage) + g.src_offset
        d.outer_stride, d.inner_stride, d.col_stride = g.outer_stride, g.inner_stride, g.col_stride
        d.cols, d.elem, d.rec_off = g.cols, g.elem, g.rec_off
    p.n_gathers = len(plan.gathers)
    p.rule_kind = RULES[plan.rule]
    p.rows, p.inner, p.alignment = plan.rows, plan.inner, plan.alignment
    p.rec_bytes, p.worst = plan.rec_bytes, plan.worst
    p.gather_blocks, p.split = gather_grid(plan.rows, plan.rec_bytes, resident)


def grid_for(params: SnapParams) -> int:
    """Gather blocks (gather_grid), then blocks for the plain copies' chunks."""
    chunks = sum(
        -(-int(params.copies[c].nbytes) // COPY_CHUNK) for c in range(int(params.n_copies))
    )
    return max(1, int(params.gather_blocks) + min(chunks, MAX_COPY_BLOCKS))


def launch_mark(fn: Any, src: int, dst: int, stream: Any) -> None:
    """Enqueue kd_mark: the u64 at device address `src` to `dst` (a mapped host address)."""
    from kdump.cuda.nvrtc import check as _check
    from kdump.cuda.nvrtc import driver as _driver

    driver = _driver()
    ptrs = (ctypes.c_uint64 * 2)(src, dst)
    args = (ctypes.c_void_p * 2)(ctypes.addressof(ptrs), ctypes.addressof(ptrs) + 8)
    _check(
        driver.cuLaunchKernel(
            fn,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            stream if isinstance(stream, driver.CUstream) else driver.CUstream(stream),
            ctypes.addressof(args),
            0,
        ),
        f"cuLaunchKernel({MARK_KERNEL})",
    )


def launch(
    fn: Any, params: SnapParams, stream: Any, grid: int | None = None, smem: int | None = None
) -> None:
    """Enqueue the snapshot on `stream` (a handle or a CUstream; no sync, no allocation:
    capturable); `smem`: its dynamic shared memory (default: SMEM_BYTES)."""
    from kdump.cuda.nvrtc import check as _check
    from kdump.cuda.nvrtc import driver as _driver

    driver = _driver()
    args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    _check(
        driver.cuLaunchKernel(
            fn,
            grid if grid is not None else grid_for(params),
            1,
            1,
            THREADS,
            1,
            1,
            SMEM_BYTES if smem is None else smem,
            stream if isinstance(stream, driver.CUstream) else driver.CUstream(stream),
            ctypes.addressof(args),
            0,
        ),
        f"cuLaunchKernel({KERNEL})",
    )
