"""The graph chain's shrinking-batch and changed-addresses steps on the CPU: the sequence derived
from a call's routing (the generic layouts and DeepGEMM's), the --routing option, and the steps'
names in the table, the verdict and --json, with a fake captured graph (a replay runs only the
recorded function's "device" part: tests/targets/graph_steps_cpu.py). The steps on real CUDA
graphs: tests/test_graph_steps_gpu.py."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import kdump
from kdump.cli import main
from kdump.errors import ExitCode, UsageError
from kdump.kernels.generic import GenericSpec
from kdump.replay import replay
from kdump.replay.graph_routing import (
    RoutingArg,
    find_routing,
    group_counts,
    shrink,
    shrink_caps,
    shrinking_sequence,
)
from kdump.replay.graph_steps import CHANGED, CHANGED_EAGER, IDENTICAL, SHRINKING, rotate
from kdump.replay.options import GraphOptions, ReplayOptions, from_keywords, parse_routing

TESTS = Path(__file__).parent
SHRUNK_1 = f"{SHRINKING} 1 (1 row per group)"
SHRUNK_2 = f"{SHRINKING} 2 (0 rows per group)"


# --- the sequence and the layouts ---------------------------------------------------------------


def test_caps_halve_with_odd_counts_down_to_none() -> None:
    assert shrink_caps(32) == [31, 16, 12, 8, 1, 0]
    assert shrink_caps(128) == [127, 64, 48, 32, 1, 0]
    assert shrink_caps(3) == [2, 1, 0]
    assert shrink_caps(2) == [1, 0]
    assert shrink_caps(1) == [0]
    assert shrink_caps(0) == []


def test_labels_keep_each_groups_first_rows() -> None:
    arg = RoutingArg("groups", "labels")
    labels = torch.tensor([1, 0, 1, -1, 0, 1, 2, -7], dtype=torch.int32)
    assert group_counts(arg, labels) == [2, 3, 1]
    got = shrink(arg, labels, 1)
    assert got.dtype == torch.int32 and got.shape == labels.shape
    # row order decides which rows stay; other negatives stay as they were
    assert got.tolist() == [1, 0, -1, -1, -1, -1, 2, -7]
    assert shrink(arg, labels, 0).tolist() == [-1, -1, -1, -1, -1, -1, -1, -7]
    grid = labels.reshape(2, 4)  # any shape: rows in row-major order
    assert shrink(arg, grid, 2).tolist() == [[1, 0, 1, -1], [0, -1, 2, -7]]


def test_counts_are_capped_per_group() -> None:
    arg = RoutingArg("masked_m", "counts")
    counts = torch.tensor([[5, 0], [3, 9]], dtype=torch.int64)
    assert group_counts(arg, counts) == [5, 0, 3, 9]
    got = shrink(arg, counts, 4)
    assert got.dtype == torch.int64 and got.tolist() == [[4, 0], [3, 4]]


def test_psum_ends_are_recomputed_from_the_kept_rows() -> None:
    from kdump.kernels.deepgemm.generators import psum_layout

    arg = RoutingArg("grouped_layout", "psum", alignment=4)
    ends = psum_layout([5, 3, 0, 6], 4)
    assert group_counts(arg, ends) == [5, 3, 0, 6]
    got = shrink(arg, ends, 2)
    assert got.tolist() == psum_layout([2, 2, 0, 2], 4).tolist()
    assert got.dtype == ends.dtype


def test_sequence_names_metrics_and_contract() -> None:
    arg = RoutingArg("groups", "labels")
    labels = torch.arange(4).repeat_interleave(32).to(torch.int32)
    steps, notes = shrinking_sequence(arg, labels, lambda _: [])
    assert not notes
    assert [s.name for s in steps] == [
        "shrinking batch 1 (31 rows per group)",
        "shrinking batch 2 (16 rows per group)",
        "shrinking batch 3 (12 rows per group)",
        "shrinking batch 4 (8 rows per group)",
        "shrinking batch 5 (1 row per group)",
        "shrinking batch 6 (0 rows per group)",
    ]
    assert steps[2].metrics == {"rows_per_group": 12, "valid_rows": 48, "captured_rows": 128}
    assert (
        steps[2].message
        == "groups keeps at most 12 rows of 32 per group: 48 rows in all, 128 at capture"
    )
    # a cap whose routing breaks the contract is left out, said in a note
    refuse = lambda cand: ["too few"] if int((cand >= 0).sum()) == 48 else []  # noqa: E731
    steps, notes = shrinking_sequence(arg, labels, refuse)
    assert len(steps) == 5 and "12 rows per group left out" in notes[0] and "too few" in notes[0]
    assert steps[2].name == "shrinking batch 3 (8 rows per group)"
    empty = torch.full((8,), -1, dtype=torch.int32)
    assert shrinking_sequence(arg, empty, lambda _: []) == (
        [],
        ["groups has no valid rows at capture: there is nothing to shrink"],
    )


@pytest.mark.parametrize(
    ("function", "shape", "layout"),
    [
        ("m_grouped_bf16_gemm_nt_contiguous", {}, "labels"),
        ("m_grouped_bf16_gemm_nt_contiguous", {"use_psum_layout": True}, "psum"),
        ("m_grouped_bf16_gemm_nt_masked", {}, "counts"),
    ],
)
def test_deepgemm_layouts_come_from_the_spec(function: str, shape: dict, layout: str) -> None:
    """DeepGEMM's spec names its routing through its touch rule; every shrunk routing keeps the
    contract (groups start on the alignment, tiles hold one group) and at most the cap."""
    from kdump.kernels.registry import spec_for

    spec = spec_for(f"deep_gemm:{function}", None)
    args, kwargs = spec.generate(seed=1, num_groups=3, n=128, k=128, expected_m=40, **shape)
    bound = spec.bind(args, kwargs)
    arg = find_routing(spec, bound, None)
    assert isinstance(arg, RoutingArg), arg
    assert arg.layout == layout and arg.source == "the kernel's spec"
    values = bound[arg.name]
    before = group_counts(arg, values)

    def violations(cand: torch.Tensor) -> list[str]:
        return [str(v) for v in spec.validate({**bound, arg.name: cand})]

    steps, notes = shrinking_sequence(arg, values, violations)
    assert not notes and len(steps) == len(shrink_caps(max(before)))
    for st in steps:
        cap = st.metrics["rows_per_group"]
        got = group_counts(arg, st.values[arg.name])
        assert got == [min(c, cap) for c in before][: len(got)], (st.name, got)
        assert spec.reference({**bound, arg.name: st.values[arg.name]})  # the oracle runs on it


def test_generic_routing_needs_the_option_and_says_so() -> None:
    spec = GenericSpec("mymod:fn", ["x", "groups", "out"])
    bound = spec.bind([torch.zeros(4), torch.zeros(4, dtype=torch.int32), torch.zeros(4)], {})
    why = find_routing(spec, bound, None)
    assert isinstance(why, str) and "--routing NAME:labels" in why and "NAME:counts" in why
    arg = find_routing(spec, bound, ("groups", "counts"))
    assert arg == RoutingArg("groups", "counts", 1, "--routing")
    missing = find_routing(spec, bound, ("labels", "labels"))
    assert isinstance(missing, str)
    assert "no argument 'labels'" in missing and "groups, out, x" in missing
    floats = find_routing(spec, bound, ("x", "labels"))
    assert isinstance(floats, str) and "not an integer tensor" in floats
    bytes_ = spec.bind([torch.zeros(4), torch.zeros(4, dtype=torch.uint8), torch.zeros(4)], {})
    unsigned = find_routing(spec, bytes_, ("groups", "labels"))  # -1 would wrap to 255
    assert isinstance(unsigned, str) and "signed integer" in unsigned
    assert isinstance(find_routing(spec, bytes_, ("groups", "counts")), RoutingArg)


def test_rotate_moves_values_of_every_float_width_only() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        base = torch.arange(24, dtype=torch.float32).to(dtype).reshape(4, 6)
        view = base[:, 1:5]  # strided: the padding columns keep their values
        before, pad = view.clone(), base[:, 0].clone()
        assert rotate(view, seed=0)
        assert not torch.equal(view.float(), before.float())
        assert sorted(view.float().flatten().tolist()) == sorted(before.float().flatten().tolist())
        assert torch.equal(base[:, 0].float(), pad.float())
    ints = torch.arange(8, dtype=torch.int32)
    assert not rotate(ints, 0) and ints.tolist() == list(range(8))
    same = torch.ones(6)
    assert not rotate(same, 0)
    broadcast = torch.randn(1, 4).expand(3, 4)
    assert not rotate(broadcast, 0)


# --- the option ----------------------------------------------------------------------------------


def test_routing_option_is_parsed_in_one_place() -> None:
    assert parse_routing("groups:labels") == ("groups", "labels")
    assert parse_routing("a:b:counts") == ("a:b", "counts")
    for bad in ("groups", "groups:", ":labels", "groups:psum"):
        with pytest.raises(UsageError, match="NAME:labels"):
            parse_routing(bad)
    opts = from_keywords(None, mode="graph", routing="masked_m:counts")
    assert opts.graph.routing_arg == ("masked_m", "counts")
    assert ReplayOptions.from_dict(opts.to_dict()) == opts  # what a child process receives
    with pytest.raises(UsageError, match="--routing"):
        GraphOptions(routing="nolayout")
    with pytest.raises(UsageError, match="--routing applies to --mode graph"):
        replace(opts, mode="eager").refuse_inapplicable()
    assert opts.for_oracle().graph.routing is None


def test_cli_refuses_a_bad_routing_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _bundle(tmp_path, "group_sum", 2)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--mode", "graph", "--routing", "groups"])
    assert exc.value.code == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "--routing groups: write NAME:labels" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--device", "cpu", "--routing", "groups:labels"])
    assert exc.value.code == ExitCode.USAGE
    assert "--routing applies to --mode graph" in capsys.readouterr().err


# --- the steps in a graph chain (fake graphs) ----------------------------------------------------


@pytest.fixture(autouse=True)
def _child_can_import_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    (tmp_path / "kdump.toml").write_text('allow-targets = ["targets.*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))


class _Graph:
    """A captured graph on the CPU: its pointers are those of capture, and no host code runs
    while it replays (the planted functions skip their host part while REPLAYING is set)."""

    def __init__(self, fn, mc) -> None:
        self.fn, self.mc = fn, mc

    def replay(self) -> None:
        from targets import graph_steps_cpu

        graph_steps_cpu.REPLAYING = True
        try:
            self.fn(*self.mc.args, **self.mc.kwargs)
        finally:
            graph_steps_cpu.REPLAYING = False


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    from kdump.replay import graph

    def capture_graph(s, mc, fn, reset):
        fn(*mc.args, **mc.kwargs)  # the warm-up
        reset()
        return _Graph(fn, mc)

    monkeypatch.setattr(graph, "capture_graph", capture_graph)
    monkeypatch.setattr(graph, "require_graphs", lambda device: None)


def _bundle(tmp_path: Path, name: str, rows_per_group: int) -> Path:
    """A call of targets.graph_steps_cpu.NAME recorded with kdump.dump_call: 4 groups of
    `rows_per_group` valid rows each."""
    from targets import graph_steps_cpu

    x = torch.randint(-4, 5, (4 * rows_per_group, 16)).float()
    groups = torch.arange(4).repeat_interleave(rows_per_group).to(torch.int32)
    path = tmp_path / f"{name}.kdump"
    kdump.dump_call(path, getattr(graph_steps_cpu, name), x, groups, torch.zeros(4, 16))
    return path


def _steps(v) -> dict:
    return {s.name: s for s in v.steps}


def _show(v) -> str:
    return v.headline() + "\n" + "\n".join(f"  {s.name} {s.status} {s.message}" for s in v.steps)


def test_steps_named_in_table_verdict_and_json(
    tmp_path: Path, cpu_graphs: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _bundle(tmp_path, "group_sum", 2)
    args = ["replay", str(path), "--mode", "graph", "--device", "cpu", "--in-process"]
    args += ["--oracle", "off"]
    with pytest.raises(SystemExit) as exc:
        main([*args, "--routing", "groups:labels", "--json"])
    assert exc.value.code == 0
    [v] = json.loads(capsys.readouterr().out)["verdicts"]
    names = [s["name"] for s in v["steps"] if "/halo" not in s["name"] and " vs " not in s["name"]]
    chain = names[names.index("graph/capture") :]
    assert chain == ["graph/capture", IDENTICAL, SHRUNK_1, SHRUNK_2, CHANGED_EAGER, CHANGED], chain
    by_name = {s["name"]: s for s in v["steps"]}
    assert by_name[SHRUNK_1]["metrics"]["rows_per_group"] == 1
    assert by_name[SHRUNK_2]["metrics"]["valid_rows"] == 0
    assert by_name[CHANGED_EAGER]["metrics"]["moved"] == 3
    assert "with other values in x" in by_name[CHANGED_EAGER]["message"]
    assert by_name[f"{CHANGED} vs identical replay"]["status"] == "ok"
    assert any("shrinking batch: groups (labels layout, from --routing)" in n for n in v["notes"])
    assert v["outcome"] == "clean"

    # without --routing the step is skipped with one line, in the table too; still clean
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith(SHRINKING))
    assert row.split()[3:5] == ["skip", "no"], row  # status, then the start of why
    assert "no routing known for this kernel" in " ".join(table.split())
    assert "verdict: clean (exit 0)" in table
    with pytest.raises(SystemExit) as exc:
        main([*args, "--json"])
    [v] = json.loads(capsys.readouterr().out)["verdicts"]
    [skipped] = [s for s in v["steps"] if s["name"] == SHRINKING]
    assert skipped["status"] == "skipped" and skipped["message"].startswith("no routing known")


def test_changed_addresses_names_a_kept_descriptor(tmp_path: Path, cpu_graphs: None) -> None:
    """Eager at new addresses is right; the replay reads that call's buffers: a mismatch
    against the identical replay, named at the changed-addresses step, and nothing earlier."""
    path = _bundle(tmp_path, "group_sum_cached", 2)
    [v] = replay([path], mode="graph", device="cpu", isolate=False, routing="groups:labels")
    assert v.exit_code == ExitCode.MISMATCH, _show(v)
    steps = _steps(v)
    assert steps[CHANGED_EAGER].status == "ok"
    assert steps[IDENTICAL].status == "ok" and steps[SHRUNK_2].status == "ok"
    compared = [s for s in v.steps if s.name == f"{CHANGED} vs identical replay"]
    assert [s.status for s in compared if s.message.startswith("out")] == ["fail"], _show(v)
    assert {f.step for f in v.findings} == {CHANGED}, _show(v)
    assert v.headline().startswith("mismatch: out differs from the identical replay")
    assert "capture-unsafe" in v.headline() and v.headline().endswith(f"(step {CHANGED})")
    fresh = steps[f"{CHANGED} vs fresh eager"]
    assert fresh.status == "fail" and "keeps state across calls" in fresh.message


def test_shrinking_batch_names_the_replay_that_faults(tmp_path: Path, cpu_graphs: None) -> None:
    path = _bundle(tmp_path, "group_sum_unchecked", 2)
    [v] = replay(
        [path], mode="graph", device="cpu", isolate=False, routing="groups:labels", oracle="off"
    )
    assert v.exit_code == ExitCode.KERNEL_ERROR, _show(v)
    [f] = v.findings
    assert f.kind == "kernel_error" and f.step == SHRUNK_1
    assert v.headline().endswith(f"(step {SHRUNK_1})")
    assert _steps(v)[IDENTICAL].status == "ok"

    # a chain restarted after that crash goes on with the rest of the sequence, and says so
    opts = from_keywords(
        None, mode="graph", device="cpu", isolate=False, routing="groups:labels", oracle="off"
    )
    opts = replace(opts, graph=replace(opts.graph, skip_steps=(IDENTICAL, SHRUNK_1)))
    [again] = replay([path], opts)
    steps = _steps(again)
    assert SHRUNK_1 not in steps and IDENTICAL not in steps
    assert "illegal memory access" in steps[SHRUNK_2].message
    assert "in a fresh process" in steps[SHRUNK_2].message
    assert again.exit_code == ExitCode.KERNEL_ERROR and again.findings[0].step == SHRUNK_2


def test_each_shrunk_replay_is_judged_by_a_fresh_eager_run(
    tmp_path: Path, cpu_graphs: None
) -> None:
    """A target without a reference: the fresh-eager oracle of each shrunk routing."""
    path = _bundle(tmp_path, "group_sum", 2)
    [v] = replay([path], mode="graph", device="cpu", isolate=False, routing="groups:labels")
    assert v.exit_code == 0 and v.outcome == "clean", _show(v)
    steps = _steps(v)
    for name in (SHRUNK_1, SHRUNK_2, CHANGED):
        assert steps[f"{name} vs fresh eager"].status == "ok", _show(v)
