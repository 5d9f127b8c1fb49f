from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls
from kdump.bundle.capture import capture
from kdump.bundle.materialize import Placement, materialize
from kdump.cli import main
from kdump.errors import ExitCode, worst_exit_code
from kdump.kernels.plugin import Tolerance
from kdump.replay import halo, replay
from kdump.replay.child import ChildRun, _crashed_replay
from kdump.replay.compare import bitwise_diff, compare_to_reference, poison, unwritten
from kdump.replay.options import ReplayOptions
from kdump.replay.session import Request
from kdump.replay.verdict import Finding, Step, Verdict

TARGETS = Path(__file__).parent


@pytest.fixture(autouse=True)
def _child_can_import_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(TARGETS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TARGETS), os.environ.get("PYTHONPATH", "")])
    )
    # These bundles name this repository's test targets: the user's config allows them.
    (tmp_path / "kdump.toml").write_text('allow-targets = ["targets.*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))


def _record(path: Path, fn_name: str, *, corrupt: bool = False, last_bit: bool = False) -> Path:
    from targets import replay_targets

    x = torch.randn(16, 8)
    out = torch.empty(16, 8)
    target = f"targets.replay_targets:{fn_name}"
    call = capture_call(target, [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    replay_targets.scale_into(x, out)
    attach_outputs(call, live, [1])
    if corrupt:
        call.outputs.data[0][4 * (3 * 8 + 5) + 2] ^= 0x40  # flip a high mantissa bit of out[3, 5]
    if last_bit:
        call.outputs.data[0][4 * (3 * 8 + 5)] ^= 0x01  # the last bit: float-atomics noise
    save_calls(path, [call])
    return path


def test_eager_clean_and_bitwise_mismatch_named(tmp_path: Path) -> None:
    good = _record(tmp_path / "good.kdump", "scale_into")
    [v] = replay([good])
    assert v.exit_code == 0, v.headline()
    assert v.backend == "library"
    assert any(s.name == "eager/run 1 vs recorded" and s.status == "ok" for s in v.steps)
    bad = _record(tmp_path / "bad.kdump", "scale_into", corrupt=True)
    [v] = replay([bad])
    assert v.exit_code == ExitCode.MISMATCH
    assert "[3, 5]" in v.headline() and "differs from the recorded output" in v.headline()


def test_last_bit_difference_is_a_note_unless_bitwise(tmp_path: Path) -> None:
    noisy = _record(tmp_path / "n.kdump", "scale_into", last_bit=True)
    [v] = replay([noisy], device="cpu", repeat=1)
    assert v.exit_code == 0, v.headline()
    assert any("not bitwise reproducible: 1 elements differ" in n for n in v.notes), v.notes
    step = next(s for s in v.steps if s.name == "eager/run 1 vs recorded")
    assert step.status == "ok" and "reproduces production" in step.message
    [v] = replay([noisy], device="cpu", repeat=1, bitwise=True)
    assert v.exit_code == ExitCode.MISMATCH
    assert v.findings[0].details["oracle"] == "recorded"


FIRST_RUN = "eager/discover outputs (recorded values)"


def test_crash_becomes_verdict_with_step(tmp_path: Path) -> None:
    [v] = replay([_record(tmp_path / "c.kdump", "crash")], repeat=1)
    assert v.exit_code == ExitCode.KERNEL_ERROR
    f = v.findings[0]
    # the first run on the recorded values is the one that finds the outputs of a target
    # without a spec
    assert f.step == FIRST_RUN and "SIGABRT" in f.message
    # steps completed before the crash survive it
    assert [s.name for s in v.steps][:2] == ["materialize", "contract"]


def test_hang_is_killed(tmp_path: Path) -> None:
    # generous: a loaded machine may need several seconds to import torch in the child
    [v] = replay([_record(tmp_path / "h.kdump", "hang")], timeout=25, repeat=1)
    assert v.exit_code == ExitCode.KERNEL_ERROR
    assert v.findings[0].kind == "hang" and v.findings[0].step == FIRST_RUN
    assert v.headline().startswith("hang: no result after 25 s; the replay process was killed")


def test_exit_without_result_is_kernel_error(tmp_path: Path) -> None:
    [v] = replay([_record(tmp_path / "e.kdump", "exits")], repeat=1)
    assert v.exit_code == ExitCode.KERNEL_ERROR
    [f] = v.findings
    assert f.step == FIRST_RUN and "exit status 3" in f.message


def test_replay_takes_typed_options(tmp_path: Path) -> None:
    bad = _record(tmp_path / "bad.kdump", "scale_into", corrupt=True)
    [v] = replay([bad], ReplayOptions(device="cpu", repeat=1, isolate=False))
    assert v.exit_code == ExitCode.MISMATCH
    assert next(s.name for s in v.steps if s.name.startswith("eager/run")) == "eager/run 1"
    assert not any(s.name.startswith("eager/run 2") for s in v.steps)


def test_raised_cuda_error_is_kernel_error(tmp_path: Path) -> None:
    [v] = replay([_record(tmp_path / "r.kdump", "raises")], repeat=1)
    assert v.exit_code == ExitCode.KERNEL_ERROR
    assert "illegal memory access" in v.headline()


def test_nondeterminism_reports_first_coordinate(tmp_path: Path) -> None:
    [v] = replay([_record(tmp_path / "n.kdump", "noisy")], repeat=3)
    kinds = {f.kind for f in v.findings}
    assert "nondeterminism" in kinds
    nd = next(f for f in v.findings if f.kind == "nondeterminism")
    assert nd.details["index"] == [0, 0]


def test_cli_json_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _record(tmp_path / "bad.kdump", "scale_into", corrupt=True)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(bad), "--json"])
    assert exc.value.code == 1
    out = json.loads(capsys.readouterr().out)
    assert out["exit_code"] == 1 and out["verdicts"][0]["findings"][0]["kind"] == "mismatch"
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(tmp_path / "missing.kdump")])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("kdump: error:")
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(bad), "--mode", "graph"])
    assert (
        exc.value.code == 125
    )  # no GPU here (skipped logic holds on GPU machines too: see gpu tests)


def test_exit_code_precedence() -> None:
    assert worst_exit_code([1, 4, 3]) == 3
    assert worst_exit_code([1, 5, 125]) == 125
    assert worst_exit_code([2, 70]) == 2
    assert worst_exit_code([]) == 0


def test_compare_reports_worst_and_first() -> None:
    exp = torch.randn(32, 16)
    got = exp.clone()
    got[7, 3] += 1.0
    got[9, 1] += 5.0
    cmp = compare_to_reference(got, exp, None, Tolerance(1e-3, 1e-2, 1e-2))
    assert not cmp.ok
    assert cmp.metrics["first_failure"]["index"] == [7, 3]
    assert cmp.metrics["worst"]["index"] == [9, 1]
    # masked rows are ignored
    mask = torch.ones(32, 1, dtype=torch.bool)
    mask[7] = mask[9] = False
    assert compare_to_reference(got, exp, mask, Tolerance(1e-3, 1e-2, 1e-2)).ok


def test_poison_is_distinguishable_from_computed_nan() -> None:
    d = torch.randn(8, 8).to(torch.bfloat16)
    poison(d)
    assert unwritten(d).all() and torch.isnan(d).all()
    d[0] = torch.tensor(float("nan")) * 1  # a computed NaN
    assert not unwritten(d)[0].any()
    got = torch.randn(8, 8, dtype=torch.bfloat16)
    assert bitwise_diff(got, got.clone()) is None
    other = got.clone()
    other[2, 6] = other[2, 6] + 1
    assert bitwise_diff(got, other)["index"] == [2, 6]


def test_halo_detects_stray_write_and_names_argument() -> None:
    d = torch.randn(64, 32)
    cap = capture([d])
    mat = materialize(cap.storages, cap.tensors, lambda i: cap.data[i], "cpu", Placement(halo=256))
    halo.fill(mat.allocations, cap.tensors)
    saved = halo.snapshot(mat.allocations)
    assert halo.check(mat.allocations, saved, cap.tensors, ["d"]) == []
    a = mat.allocations[0]
    a.buffer[a.span_offset + a.span_nbytes + 16] = 0  # 16 bytes past d's end
    [v] = halo.check(mat.allocations, saved, cap.tensors, ["d"])
    assert v.side == "after" and v.offset == 16
    assert "guard after d (first 16 bytes past its end)" in v.describe()


def test_halo_poisons_and_the_second_poison_on_the_cpu() -> None:
    """Every CPU storage gets halos before (a view's unrecorded prefix included) and after its
    span; the second poison is finite in every float format and differs for integers;
    fill_beyond leaves the bytes nearest the span as they are."""
    base = torch.randn(40)
    x = base[8:]  # a view: 32 bytes of its storage before the span are not recorded
    labels = torch.arange(16, dtype=torch.int32)
    cap = capture([x, labels])
    mat = materialize(cap.storages, cap.tensors, lambda i: cap.data[i], "cpu", Placement(halo=64))
    halo.fill(mat.allocations, cap.tensors)
    fx, fl = mat.allocations
    assert fx.prefix == 32 and fx.span_offset >= 64 + 32
    assert bool((fx.buffer[: fx.span_offset] == 0xFF).all())
    assert bool((fx.buffer[fx.span_offset + fx.span_nbytes :] == 0xFF).all())
    assert bool((fl.buffer[fl.span_offset + fl.span_nbytes :] == 0x7F).all())
    assert torch.equal(mat.tensors[0], x) and torch.equal(mat.tensors[1], labels)
    halo.fill(mat.allocations, cap.tensors, variant=1)
    after = fx.buffer[fx.span_offset + fx.span_nbytes :][:4].view(torch.float32)
    assert float(after) == pytest.approx(1.33e7, rel=1e-2)
    for dt in (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        word = torch.full((dt.itemsize,), halo.FLOAT_FILL_B, dtype=torch.uint8).view(dt)
        assert bool(torch.isfinite(word.float()).all()), dt
    assert bool((fl.buffer[: fl.span_offset] == 0x40).all())
    halo.fill(mat.allocations, cap.tensors)
    halo.fill_beyond(fx, "after", 16, halo.FLOAT_FILL_B)
    end = fx.span_offset + fx.span_nbytes
    assert bool((fx.buffer[end : end + 16] == 0xFF).all())
    assert bool((fx.buffer[end + 16 :] == halo.FLOAT_FILL_B).all())
    halo.fill_beyond(fx, "before", 8, halo.FLOAT_FILL_B)
    assert bool((fx.buffer[fx.span_offset - 8 : fx.span_offset] == 0xFF).all())
    assert bool((fx.buffer[: fx.span_offset - 8] == halo.FLOAT_FILL_B).all())
    assert torch.equal(mat.tensors[0], x)  # the spans never change


def test_graph_restart_logic_picks_crashed_replay() -> None:
    v = Verdict("b", 0, "t", "graph")
    v.steps.append(Step("graph/replay 2 (all empty)", "error", "x"))
    v.findings.append(Finding("kernel_error", "graph/replay 2 (all empty)", "replay crashed"))
    assert _crashed_replay(ChildRun(v)) == "graph/replay 2 (all empty)"
    assert _crashed_replay(ChildRun(Verdict("b", 0, "t", "graph"), died_at="graph/capture")) is None
    assert _crashed_replay(ChildRun(Verdict("b", 0, "t", "graph"), "graph/replay 1 (x)")) == (
        "graph/replay 1 (x)"
    )


def test_graph_chain_continues_in_fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay that kills the context is reported, and the chain goes on from the next step."""
    from kdump.replay import child

    runs: list[list[str]] = []
    steps = ["graph/replay identical", "graph/replay 1 (a)", "graph/replay 2 (b)"]

    def fake(req: Request, timeout: float | None, env: dict | None) -> ChildRun:
        skip = set(req.options.graph.skip_steps)
        runs.append(sorted(skip))
        v = Verdict(req.bundle, req.call, "t", "graph")
        begun = []
        for s in steps:
            if s in skip:
                continue
            begun.append(s)
            if s == "graph/replay 1 (a)":
                return ChildRun(v, died_at=s, begun=begun)
            v.steps.append(Step(s, "ok"))
        return ChildRun(v, None, begun)

    monkeypatch.setattr(child, "run_child", fake)
    v = child.run_in_child(Request("b", 0, ReplayOptions(mode="graph")), None)
    names = [s.name for s in v.steps]
    assert "graph/replay 2 (b)" in names and "restart" in names
    assert len(runs) == 2 and "graph/replay 1 (a)" in runs[1]


def test_overread_attributed_to_tensor_by_halo(tmp_path: Path) -> None:
    from targets import replay_targets

    x = torch.randn(16, 8)
    out = torch.empty(16, 8)
    call = capture_call("targets.replay_targets:overread", [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    replay_targets.scale_into(x, out)
    attach_outputs(call, live, [1])
    save_calls(tmp_path / "o.kdump", [call])
    [v] = replay([tmp_path / "o.kdump"], repeat=1)
    mem = [f for f in v.findings if f.kind == "memory"]
    assert mem and mem[0].details["tensors"] == ["x"] and mem[0].details["side"] == "after"
    assert mem[0].details["bytes"] == 32 and mem[0].details["evidence"] == "halo differential"
    assert mem[0].details["outputs"] == ["out[15:16]"]  # one row of 8 float32 past x
    assert "reads past the end of x: out[15:16] follow the poison after x, 32 bytes" in (
        mem[0].message
    )
    assert v.exit_code == ExitCode.MEMORY_FINDING
