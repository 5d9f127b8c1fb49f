"""The flight recorder's snapshot kernel on its own, against a plain copy of the same bytes, for
the kernel as shipped and for variants of its compile-time constants, all in one run on one GPU.

    python lab/bench_snapshot_kernel.py
    python lab/bench_snapshot_kernel.py --variant KD_UNROLL=8u --variant min_blocks=4

A variant is comma-separated `NAME=VALUE` pairs: one of the -D flags kdump/record/flight/gather.py
builds snapshot.cu with (gather.DEFINES) replaced (KD_UNROLL, KD_THREADS, KD_ROWS_PER_BLOCK,
KD_BULK_WARPS, KD_BULK_STAGES, KD_BULK_STAGE, KD_UNITS, KD_MIN_BLOCKS or `min_blocks` (the
kernel's `__launch_bounds__` minimum blocks per SM), ...; KD_CHUNK follows KD_THREADS x 16 x
KD_UNROLL and KD_BUF_WORDS the buffers), KD_SPLIT_BYTES (a unit's rows at most, in bytes:
1073741824 = one unit per window; the host's gather.SPLIT_BYTES), the switches the shipped
kernel no longer has, as patches: KD_BULK=0 (no bulk copies), KD_DENSE=0 (no window of scales
read whole), KD_OVERLAP=0 (a call's rows, then its scales, not side by side), KD_EARLY_LAUNCH=1|2
(let a PDL-launched kernel start at a block's start | after its copies); or `resident=N` (at most
N gather blocks taking the units round robin; 0: one block per unit; default: as many as the GPU
holds at once, as the recorder launches), `balance=1` (as few of those blocks as take the same
number of rounds of units, so that every block takes as many), or `patch=NAME+NAME` (see
PATCHES: timing experiments that take a part of the launch out: fixed-rows, no-counter,
no-publication, no-host-writes, no-gather, no-fence, no-copies; and the switches above). The host
side (gather.py) must agree with KD_THREADS and KD_ROWS_PER_BLOCK: variants of those launch with
the variant's own grid. lab/flight_variants.py --define takes the same pairs.

Cases (the reference decode shape: G = 288 experts padded to 128 rows, M = 36,864, K = 4096):
- bytes: 64 MB in 16 plain byte ranges (the kernel's copy blocks);
- gather-all 64 / 256 MB: every row of a [rows, 4096] tensor of that size (the row gather's
  rate, against a plain copy of the same bytes timed in the same run);
- gather-all: every row of A [M, 4096] (the kernel's gather blocks at full routing);
- decode T / scales: the labels rule at T tokens per expert, A's fp32 MN-major scales
  [M, 32] gathered and the labels (147 KB) copied, as a recorded call without activations;
- decode T / scales, host marks: the same, also writing what a recorded graph step writes over
  PCIe (the host slot's `pre` mark, the chain's done marker of the call before);
- decode T / A+scales: the same with A's valid rows.
Times are per launch: big cases by events over ten launches, decode cases by events over a CUDA
graph of 20 launches (as a recorded graph step runs it). "bound" is the bytes the launch moves
at the plain copy's rate measured in the same run; "torch row gather" is torch.index_select of
the same rows into a dense tensor (no records), a general-purpose gather beside the plain copy.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kdump.bundle.tensors import group_storages
from kdump.record.flight import gather

G, BLOCK, K = 288, 128, 4096
M = G * BLOCK
# A loaded build: (kd_snapshot, threads per block, rows per gather window, plain-copy chunk bytes,
# dynamic shared memory bytes, split bytes, gather blocks at most (0: one per unit), balance=1)
Kernel = tuple[Any, int, int, int, int, int, int, bool]


# Timing experiments (`patch=NAME+NAME`): parts of the launch taken out to see what each costs.
# Their slots are not valid snapshots (row counts, publication); never for recording.
PATCHES: dict[str, tuple[tuple[str, str], ...]] = {
    # each unit's records at its window's own place: no row-counter round trip
    "fixed-rows": (
        (
            "if (tid == 0) s_base = atomicAdd(&rec->row_counter, n);",
            "if (tid == 0) s_base = window * KD_ROWS_PER_BLOCK + lo;",
        ),
        (
            "if (tid == 0 && count) base = atomicAdd(&rec->row_counter, count);",
            "if (tid == 0 && count) base = window * KD_ROWS_PER_BLOCK;",
        ),
    ),
    # block 0 publishes as soon as it is done: no block counter round trip, the same writes
    # (with fixed-rows)
    "no-counter": (
        (
            "s_last = atomicAdd(&rec->done_blocks, 1u) == gridDim.x - 1;",
            "s_last = blockIdx.x == 0;",
        ),
    ),
    # nobody publishes (with fixed-rows)
    "no-publication": (("if (!s_last || tid != 0) return;", "return;"),),
    # no write over PCIe: neither the chain's done marker of the call before nor the host
    # slot's `pre` mark
    "no-host-writes": (
        (
            "if (done && tok) *(volatile u64*)done = *(volatile u64*)tok;",
            "(void)done; (void)tok;",
        ),
        (
            "if (p.host_pre) *(volatile u64*)p.host_pre = token;",
            "(void)token;",
        ),
    ),
    # the gather blocks copy no row (the records' row indices are still written)
    "no-gather": (
        (
            "for (u32 gi = 0; gi < p.n_gathers; ++gi)",
            "for (u32 gi = 0; gi < 0u; ++gi)",
        ),
        (
            "dense_store(p, window, s_rows, count, out, tid, s_stage);",
            "(void)out;",
        ),
        ("if (pair >= 0 && ((u64)out & 15) == 0) {", "if (pair < -1) {"),
    ),
    # no fence before a block counts itself done (with no-publication)
    "no-fence": (
        (
            "  __threadfence();\n  __syncthreads();\n  // (One 64-bit word",
            "  __syncthreads();\n  // (One 64-bit word",
        ),
    ),
    # the plain copies' blocks copy nothing
    "no-copies": (("for (u32 c = 0; c < p.n_copies; ++c) {", "for (u32 c = 0; c < 0u; ++c) {"),),
    # The switches the shipped kernel had (its values then are the shipped paths). KD_BULK=0:
    # the plain loads and stores everywhere (what a GPU before sm_90 runs).
    "no-bulk": (
        (
            "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n#define KD_HAVE_BULK 1",
            "#if 0\n#define KD_HAVE_BULK 1",
        ),
    ),
    # KD_DENSE=0: scales read only where rows are touched, after the rule (no whole windows)
    "no-dense": (("  if (p.n_gathers != 1 || p.split > 1) return false;", "  return false;"),),
    # KD_OVERLAP=0: a call's rows, then its scales, not side by side
    "no-overlap": (("  if (p.n_gathers != 2) return -1;", "  return -1;"),),
    # KD_EARLY_LAUNCH=1: a recorded kernel launched with programmatic dependent launch
    # (DeepGEMM's set_pdl) may start its prologue once every block of the snapshot has started
    # (its grid-dependency wait still holds it until this grid has finished and its writes are
    # visible). H200, DeepGEMM with PDL, metadata and scales: the same step within 0.01x at 1
    # and 32 tokens per expert, and at 113 tokens 1.11x against 1.06x without: the GEMM's early
    # blocks slow the snapshot's. Not shipped.
    "early-launch-start": (
        (
            "  const u32 tid = threadIdx.x;\n  // The launch is a chain",
            "  const u32 tid = threadIdx.x;\n"
            "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n"
            '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n'
            "#endif\n"
            "  // The launch is a chain",
        ),
    ),
    # KD_EARLY_LAUNCH=2: the same after a block's copies, before the publication (H200, same
    # step: 1.08x at 113 tokens against 1.06x). Not shipped.
    "early-launch-end": (
        (
            "  // The last block to finish publishes the call",
            "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n"
            '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n'
            "#endif\n"
            "  // The last block to finish publishes the call",
        ),
    ),
}

# The old #define switches of snapshot.cu, as the patches above (results history and the
# commands written there keep working).
SWITCHES = {
    ("KD_BULK", "0"): "no-bulk",
    ("KD_DENSE", "0"): "no-dense",
    ("KD_OVERLAP", "0"): "no-overlap",
    ("KD_EARLY_LAUNCH", "1"): "early-launch-start",
    ("KD_EARLY_LAUNCH", "2"): "early-launch-end",
}
SHIPPED = {("KD_BULK", "1"), ("KD_DENSE", "1"), ("KD_OVERLAP", "1"), ("KD_EARLY_LAUNCH", "0")}

# A patch that is only safe beside another. Without fixed-rows the row counter would no longer
# be reset after every block reserved its records; a publication without the fence could
# precede the writes it vouches for.
NEEDS = {"no-counter": "fixed-rows", "no-publication": "fixed-rows", "no-fence": "no-publication"}


def patched(src: str, names: str) -> str:
    """`src` with the PATCHES named in `names` ("a+b") applied, each exactly once."""
    chosen = [name for name in names.split("+") if name]
    for name in chosen:
        if name not in PATCHES:
            raise SystemExit(f"no patch {name!r}: one of {', '.join(PATCHES)}")
        need = NEEDS.get(name)
        if need is not None and need not in chosen:
            raise SystemExit(f"patch {name} needs {need} too")
        for old, new in PATCHES[name]:
            if src.count(old) != 1:
                raise SystemExit(f"patch {name}: snapshot.cu no longer has {old!r} once")
            src = src.replace(old, new)
    return src


@dataclasses.dataclass(frozen=True)
class Variant:
    """A build of snapshot.cu: its source (patched or not) and -D flags, and what the host
    launches it with."""

    source: str
    defines: dict[str, str]
    threads: int
    rows_per_block: int
    chunk: int
    smem: int
    split_bytes: int


def _num(value: str) -> int:
    return int(value.rstrip("uUlL"), 0)


def variant(spec: str) -> Variant:
    """The build of a variant spec ("" = as shipped)."""
    src = gather.kernel_source()
    defines = dict(gather.DEFINES)
    split_bytes = gather.SPLIT_BYTES
    patches: list[str] = []
    for kv in (kv for kv in spec.split(",") if kv):
        name, value = kv.split("=", 1)
        if name in ("resident", "balance") or (name, value) in SHIPPED:
            continue
        if name == "patch":
            patches += [n for n in value.split("+") if n]
        elif (name, value) in SWITCHES:
            patches.append(SWITCHES[name, value])
        elif name == "KD_SPLIT_BYTES":
            split_bytes = _num(value)
        else:
            name = "KD_MIN_BLOCKS" if name == "min_blocks" else name
            if name not in defines or name in ("KD_CHUNK", "KD_BUF_WORDS"):
                raise SystemExit(f"no -D {name} to vary: one of {', '.join(gather.DEFINES)}")
            defines[name] = value
    src = patched(src, "+".join(patches))
    threads, unroll = _num(defines["KD_THREADS"]), _num(defines["KD_UNROLL"])
    chunk = threads * 16 * unroll
    defines["KD_CHUNK"] = f"{chunk}ull"
    bulk = _num(defines["KD_BULK_WARPS"]) * _num(defines["KD_BULK_STAGES"])
    words = max(bulk * _num(defines["KD_BULK_STAGE"]) // 4, _num(defines["KD_STAGE_WORDS"]))
    defines["KD_BUF_WORDS"] = str(words)
    rows = _num(defines["KD_ROWS_PER_BLOCK"])
    return Variant(src, defines, threads, rows, chunk, 4 * words, split_bytes)


def load_function(src: str, name: str, defines: dict[str, str] | None = None) -> Any:
    """Kernel `name` of CUDA source `src` (built with -D `defines`), compiled by NVRTC for the
    current GPU and loaded."""
    from cuda.core import Program, ProgramOptions

    from kdump.cuda.nvrtc import check, driver

    arch = gather.arch_of(torch.cuda.get_device_capability())
    flags = gather.define_flags(defines) if defines else []
    opts = ProgramOptions(arch=arch, std="c++17", define_macro=flags)
    obj = Program(src, "c++", opts).compile("cubin")
    torch.cuda.current_stream()
    module = check(driver().cuModuleLoadData(bytes(obj.code)), "cuModuleLoadData")
    return check(driver().cuModuleGetFunction(module, name.encode()), f"get {name}")


def load(v: Variant) -> Any:
    """kd_snapshot of a variant, allowed its dynamic shared memory."""
    fn = load_function(v.source, "kd_snapshot", v.defines)
    gather.allow_smem(fn, v.smem)
    return fn


def launch(fn: Any, p: gather.SnapParams, threads: int, grid: int, smem: int) -> None:
    """gather.launch with the build's own block size (gather.launch uses the shipped one)."""
    from kdump.cuda.nvrtc import check, driver

    d = driver()
    args = (ctypes.c_void_p * 1)(ctypes.addressof(p))
    stream = d.CUstream(torch.cuda.current_stream().cuda_stream)
    check(
        d.cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, smem, stream, ctypes.addressof(args), 0),
        "cuLaunchKernel",
    )


def events_us(run: Any, reps: int) -> float:
    run()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        a.record()
        for _ in range(reps):
            run()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


def graph_us(step: Any, launches: int = 20) -> float:
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            step()
    return events_us(g.replay, 5) / launches


class Case:
    """Buffers and kernel arguments of one case (shared by every variant)."""

    def __init__(
        self,
        name: str,
        tensors: list[torch.Tensor],
        gathered: list[int],
        rule: torch.Tensor | None,
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        moved: int,
        graph: bool,
        pad: int = 0,
        marks: bool = False,
    ) -> None:
        self.name, self.moved, self.graph = name, moved, graph
        self.keep = [tensors, copies]
        self.p = p = gather.SnapParams()
        for k, (s, d) in enumerate(copies):
            p.copies[k].src, p.copies[k].dst = s.data_ptr(), d.data_ptr()
            p.copies[k].nbytes = s.numel() * s.element_size()
        p.n_copies = len(copies)
        self.ctrl = torch.zeros(2, dtype=torch.int64, device="cuda")
        self.record = torch.zeros(8, dtype=torch.int64, device="cuda")
        p.ctrl, p.record, p.seq = self.ctrl.data_ptr(), self.record.data_ptr(), 1
        if marks:  # as in a recorded graph: the host slot's `pre` and the chain's done marker,
            # written over PCIe into pinned (mapped) memory; the chain cell and token on the GPU
            self.host = torch.zeros(2, dtype=torch.int64, pin_memory=True)
            self.cell = torch.zeros(2, dtype=torch.int64, device="cuda")
            self.token = torch.zeros(1, dtype=torch.int64, device="cuda")
            p.host_pre, p.host_done = self.host.data_ptr(), self.host.data_ptr() + 8
            p.chain, p.token_ptr = self.cell.data_ptr(), self.token.data_ptr()
        self.plan = None
        if gathered:
            storages, records = group_storages(tensors)
            rule_i = None if rule is None else next(i for i, t in enumerate(tensors) if t is rule)
            kind = "all" if rule is None else "labels"
            plan = gather.make_plan(tensors, records, storages, gathered, kind, rule_i, 1)
            assert plan is not None
            if pad:  # each record's rows start at a multiple of `pad` bytes
                rows, off = [], -gather.SLOT_HEAD % pad or pad  # records follow the slot head
                for g in plan.gathers:
                    rows.append(dataclasses.replace(g, rec_off=off))
                    off += -(-(g.cols * g.elem) // pad) * pad
                rec = -(-off // pad) * pad
                plan = dataclasses.replace(plan, gathers=tuple(rows), rec_bytes=rec)
            self.plan = plan
            gather.set_plan(
                p, self.plan, lambda i: int(storages[i].base_ptr) + int(storages[i].span_start)
            )
            self.ring = torch.empty(2 * self.plan.worst, dtype=torch.uint8, device="cuda")
            p.ring, p.ring_bytes = self.ring.data_ptr(), self.ring.numel()
            if rule is not None:
                p.rule, p.rule_n = rule.data_ptr(), rule.numel()

    def step(self, kernel: Kernel) -> Callable[[], None]:
        """One launch of this case with `kernel`'s build (its block size, rows per block and
        copy chunk: gather.grid_for's rule with that build's constants)."""
        fn, threads, rows_per_block, chunk, smem, split_bytes, resident, balance = kernel
        p = self.p
        if self.plan is not None:
            p.gather_blocks, p.split = gather.gather_grid(
                self.plan.rows, self.plan.rec_bytes, resident, rows_per_block, split_bytes
            )
            if balance and p.gather_blocks:  # as few blocks as take the same rounds of units
                units = -(-self.plan.rows // rows_per_block) * p.split
                rounds = -(-units // p.gather_blocks)
                p.gather_blocks = -(-units // rounds)
        chunks = sum(-(-int(p.copies[c].nbytes) // chunk) for c in range(int(p.n_copies)))
        grid = max(1, int(p.gather_blocks) + min(chunks, gather.MAX_COPY_BLOCKS))
        return lambda: launch(fn, p, threads, grid, smem)

    def time(self, kernel: Kernel) -> float:
        step = self.step(kernel)
        return graph_us(step) if self.graph else events_us(step, 10)


def labels(tokens: int) -> torch.Tensor:
    """Expert e's block of 128 rows holds `tokens` rows labelled e, then padding (-1)."""
    expert = torch.arange(G, device="cuda").repeat_interleave(BLOCK)
    valid = (torch.arange(BLOCK, device="cuda") < tokens).repeat(G)
    return torch.where(valid, expert, -1).to(torch.int32)


def cases() -> list[Case]:
    out = []
    for mb in (64, 256):
        n = mb << 20
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        per = n // gather.MAX_COPIES
        ranges = [(src[c * per : (c + 1) * per], dst[c * per : (c + 1) * per]) for c in range(16)]
        out.append(Case(f"bytes {mb} MB", [], [], None, ranges, n, False))
    for mb in (64, 256):  # every row of an A of that size: the gather's rate at big sizes
        big = torch.randint(0, 255, ((mb << 20) // K, K), dtype=torch.uint8, device="cuda")
        out.append(Case(f"gather-all {mb} MB", [big], [0], None, [], big.numel(), False))
    a = torch.randint(0, 255, (M, K), dtype=torch.uint8, device="cuda")
    out.append(Case("gather-all A", [a], [0], None, [], a.numel(), False))
    out.append(Case("gather-all A, 128 B records", [a], [0], None, [], a.numel(), False, 128))
    sfa = torch.empty_strided((M, K // 128), (1, M), dtype=torch.float32, device="cuda")
    sfa.copy_(torch.randn(M, K // 128, device="cuda"))
    twin = torch.empty(M, dtype=torch.int32, device="cuda")
    for tokens in (1, 32, 113):
        lab = labels(tokens)
        rows = G * tokens
        for what, gathered, row_bytes, marks in (
            ("scales", [1], K // 32, False),
            ("scales, host marks", [1], K // 32, True),
            ("A+scales", [0, 1], K + K // 32, False),
        ):
            out.append(
                Case(
                    f"decode {tokens} / {what}",
                    [a, sfa, lab],
                    gathered,
                    lab,
                    [(lab, twin)],
                    rows * row_bytes + lab.numel() * 4,
                    True,
                    marks=marks,
                )
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[], help="NAME=VALUE[,...]")
    ap.add_argument("--case", default="", help="only the cases whose name contains this")
    ap.add_argument("--once", action="store_true", help="launch each case once, untimed (ncu)")
    opt = ap.parse_args()
    specs = ["", *opt.variant]
    all_cases = [c for c in cases() if opt.case in c.name]
    probe = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    probe2 = torch.empty_like(probe)
    rate = probe.numel() / events_us(lambda: probe2.copy_(probe), 10) / 1e3  # GB/s
    print(f"plain D2D copy: {rate:.0f} GB/s of data (each byte read and written)\n")
    kernels: list[Kernel] = []
    for spec in specs:
        v = variant(spec)
        fn = load(v)
        defs = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
        fixed = defs.get("resident")
        resident = gather.resident_blocks(fn, v.smem, v.threads) if fixed is None else int(fixed)
        balance = defs.get("balance") == "1"
        print(f"{spec or 'as shipped'}: {resident} gather blocks at most")
        kernels.append(
            (fn, v.threads, v.rows_per_block, v.chunk, v.smem, v.split_bytes, resident, balance)
        )
    head = "| case | bound us | plain copy us | torch row gather us | "
    print(head + " | ".join(s or "as shipped" for s in specs) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(specs))
    if opt.once:
        for c in all_cases:
            for kernel in kernels:
                c.step(kernel)()
        probe2.copy_(probe)
        torch.cuda.synchronize()
        return
    for c in all_cases:
        bound = c.moved / rate / 1e3
        plain = "-"
        if not c.graph:  # a plain copy of the same bytes, the big cases' baseline
            s1 = torch.empty(c.moved, dtype=torch.uint8, device="cuda")
            s2 = torch.empty_like(s1)
            bound = events_us(lambda s1=s1, s2=s2: s2.copy_(s1), 10)
            plain = f"{bound:.1f}"
            del s1, s2
        torch_gather = "-"
        if c.name.startswith("gather-all") and "records" not in c.name:
            # torch's own gather of the same rows (index_select into a dense [rows, K] tensor):
            # what a general-purpose row gather reaches on this GPU, beside the plain copy
            src_t = c.keep[0][0]
            idx = torch.arange(src_t.shape[0], device="cuda")
            dst_t = torch.empty_like(src_t)
            us = events_us(lambda: torch.index_select(src_t, 0, idx, out=dst_t), 10)  # noqa: B023
            torch_gather = f"{us:.1f} ({bound / us:.2f}x)"
            del dst_t
        cells = []
        for kernel in kernels:
            us = c.time(kernel)
            cells.append(f"{us:.1f} ({bound / us:.2f}x)")
        row = f"| {c.name} | {c.moved / rate / 1e3:.1f} | {plain} | {torch_gather} | "
        print(row + " | ".join(cells) + " |")
    print(
        "\n(x) = a plain copy of the same bytes (big cases; decode cases: the bytes at the 256 MB "
        "copy's rate) / time"
    )


if __name__ == "__main__":
    main()
