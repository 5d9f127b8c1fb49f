"""Verdicts on generic targets: tolerance policy, the fresh-eager oracle, the halo differential
without a reference, no silent clean, CLI refusals and JSON errors (CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls
from kdump.cli import main
from kdump.errors import ExitCode
from kdump.replay import replay
from kdump.replay.compare import agree, default_tolerance, distinct_results
from kdump.replay.oracle import FreshResult, story

TESTS = Path(__file__).parent


@pytest.fixture(autouse=True)
def _child_can_import_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    # These bundles name this repository's test targets: the user's config allows them.
    (tmp_path / "kdump.toml").write_text('allow-targets = ["targets.*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))


def _one(path: Path, fn: str, args: list, names: list[str], outs: list[int], produce) -> Path:
    target = fn if ":" in fn else f"targets.verdict_targets:{fn}"
    call = capture_call(target, args, {}, names=names)
    live = input_tensors(call, args, {})
    produce(*args)
    attach_outputs(call, live, outs)
    save_calls(path, [call])
    return path


def _rowsum_bundle(path: Path) -> Path:
    from targets import verdict_targets

    x = torch.randn(64, 256)
    return _one(
        path,
        "atomic_rowsum",
        [x, torch.empty(64)],
        ["x", "out"],
        [1],
        verdict_targets.atomic_rowsum,
    )


def test_dtype_tolerance_policy() -> None:
    a = torch.randn(128, 64)
    b = a.clone()
    b.view(torch.int32)[5, 7] ^= 1  # last bit
    ag = agree(a, b)
    assert ag.ok and not ag.exact and ag.metrics["differing"] == 1
    assert "not bitwise reproducible: 1 elements differ" in ag.note
    assert not agree(a, b, bitwise=True).ok
    c = a.clone()
    c[3, 2] += 0.5
    bad = agree(a, c)
    assert not bad.ok and "[3, 2]" in bad.message
    ints = torch.randint(0, 9, (32,))
    other = ints.clone()
    other[4] += 1
    assert not agree(ints, other).ok  # integers are exact
    assert default_tolerance(torch.bfloat16).rtol > default_tolerance(torch.float32).rtol
    assert distinct_results([a, b, c, a], None) == 2


def test_atomics_noise_is_clean_with_note(tmp_path: Path) -> None:
    path = _rowsum_bundle(tmp_path / "a.kdump")
    [v] = replay([path], device="cpu", repeat=4)
    assert v.exit_code == 0, v.headline()
    assert any("not bitwise reproducible" in n and "float atomics?" in n for n in v.notes)
    step = next(s for s in v.steps if s.name == "eager/halo differential")
    assert step.status == "ok", step.message  # atomics noise is not a read of a halo
    [v] = replay([path], device="cpu", repeat=4, bitwise=True)
    assert v.exit_code == ExitCode.MISMATCH
    assert "memory" not in {f.kind for f in v.findings}
    nd = [f for f in v.findings if f.kind == "nondeterminism"]
    assert nd and "distinct results in 4 runs" in nd[0].message


def test_nondeterminism_counts_distinct_results(tmp_path: Path) -> None:
    from targets import replay_targets

    x = torch.randn(16, 8)
    path = _one(
        tmp_path / "n.kdump",
        "targets.replay_targets:noisy",
        [x, torch.empty(16, 8)],
        ["x", "out"],
        [1],
        replay_targets.noisy,
    )
    [v] = replay([path], device="cpu", repeat=3)
    [nd] = [f for f in v.findings if f.kind == "nondeterminism"]
    assert "nondeterministic: 3 distinct results in 3 runs" in nd.message
    assert v.exit_code == ExitCode.MISMATCH


def _workspace_bundle(path: Path) -> Path:
    from targets import verdict_targets

    verdict_targets.reset()
    x = torch.randn(32, 8)
    out = torch.empty(32, 8)
    labels = torch.full((32,), -1, dtype=torch.int64)
    calls = []
    for n in (10, 25):  # the second call routes more rows into the same buffers
        labels.fill_(-1)
        labels[:n] = 0
        call = capture_call(
            "targets.verdict_targets:workspace_rows",
            [x, labels, out],
            {},
            names=["x", "labels", "out"],
        )
        live = input_tensors(call, [x, labels, out], {})
        verdict_targets.workspace_rows(x, labels, out)  # production: in sequence, stale rows
        attach_outputs(call, live, [2])
        calls.append(call)
    save_calls(path, calls)
    return path


def test_fresh_eager_oracle_names_state_across_calls(tmp_path: Path) -> None:
    path = _workspace_bundle(tmp_path / "w.kdump")
    [first] = replay([path], calls=[0], device="cpu", repeat=1)
    assert first.exit_code == 0, first.headline()
    [v] = replay([path], calls=[1], device="cpu", repeat=1)
    assert v.exit_code == ExitCode.MISMATCH, v.headline()
    step = next(s for s in v.steps if s.name == "eager/run 1 vs fresh eager")
    assert step.status == "fail"
    assert "matches what production recorded" in step.message
    assert "keeps state across calls (capture-unsafe)" in v.headline()
    rec = next(s for s in v.steps if s.name == "eager/run 1 vs recorded")
    assert "reproduces production" in rec.message


def test_story_of_the_fresh_oracle() -> None:
    agrees = FreshResult(True, True, 0, 0.0, "")
    differs = FreshResult(True, False, 120, 3.5, "")
    assert story(agrees, True) == (True, "matches a fresh eager run of the same inputs")
    ok, text = story(differs, True)
    assert not ok and "(120 elements, max error 3.5) and matches what production recorded" in text
    ok, text = story(differs, False)
    assert not ok and "and from what production recorded" in text
    ok, text = story(FreshResult(False, False, 0, 0.0, "it crashed"), None)
    assert ok and "it crashed" in text


def test_overread_attributed_without_reference(tmp_path: Path) -> None:
    x = torch.randn(16, 8)
    path = _one(
        tmp_path / "o.kdump",
        "targets.replay_targets:overread",
        [x, torch.empty(16, 8)],
        ["x", "out"],
        [1],
        lambda x, out: out.copy_(torch.cat([x[1:], x[:1]]) * 2),
    )
    [v] = replay([path], device="cpu", repeat=1)
    assert v.exit_code == ExitCode.MEMORY_FINDING, v.headline()
    assert v.headline().startswith(
        "memory: reads past the end of x: out[15:16] follow the poison after x, 32 bytes"
    )
    assert "evidence: the halo differential" in v.headline()


def test_no_oracle_is_never_plain_clean(tmp_path: Path) -> None:
    x = torch.randn(16, 8)
    call = capture_call(
        "targets.replay_targets:scale_into", [x, torch.empty(16, 8)], {}, names=["x", "out"]
    )
    save_calls(tmp_path / "n.kdump", [call])
    [v] = replay([tmp_path / "n.kdump"], device="cpu", repeat=1)
    assert v.exit_code == 0 and v.headline() == "ran without error — no oracle to compare with"


def test_mode_all_without_gpu_is_not_a_silent_clean(tmp_path: Path) -> None:
    path = _rowsum_bundle(tmp_path / "a.kdump")
    [v] = replay([path], mode="all", device="cpu", repeat=1)
    assert v.exit_code == ExitCode.CANNOT_RUN
    assert "could not run" in v.headline()
    x = torch.randn(16, 8)
    bad = _one(
        tmp_path / "b.kdump",
        "targets.replay_targets:overread",
        [x, torch.empty(16, 8)],
        ["x", "out"],
        [1],
        lambda x, out: out.copy_(x),
    )
    [v] = replay([bad], mode="all", device="cpu", repeat=1)
    assert v.exit_code == ExitCode.MEMORY_FINDING  # a reproduced failure keeps its own code


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return int(exc.value.code), out.out, out.err


@pytest.mark.parametrize(
    "extra",
    [["--then", "x.kdump"], ["--tool", "racecheck"], ["--save-failing", "d"]],
)
def test_options_that_do_not_apply_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    path = _rowsum_bundle(tmp_path / "a.kdump")
    code, _, err = _cli(["replay", str(path), "--device", "cpu", *extra], capsys)
    assert code == 2 and "applies to --mode" in err
    code, out, _ = _cli(["replay", str(path), "--device", "cpu", "--json", *extra], capsys)
    assert code == 2 and "applies to --mode" in json.loads(out)["error"]


def test_oracle_fresh_refused_in_sanitizer_mode(tmp_path: Path, capsys) -> None:
    path = _rowsum_bundle(tmp_path / "a.kdump")
    code, _, err = _cli(["replay", str(path), "--mode", "sanitizer", "--oracle", "fresh"], capsys)
    assert code == 2 and "--oracle fresh applies" in err


def test_json_usage_error_is_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["replay", "x.kdump", "--mode", "nope", "--json"], capsys)
    assert code == 2 and json.loads(out)["exit_code"] == 2


def test_folder_with_unreadable_bundle_replays_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "caps"
    folder.mkdir()
    _rowsum_bundle(folder / "a.kdump")
    (folder / "b.kdump").write_bytes(os.urandom(64))
    code, out, _ = _cli(
        ["replay", str(folder), "--device", "cpu", "--repeat", "1", "--json"], capsys
    )
    doc = json.loads(out)
    assert code == 2 and doc["exit_code"] == 2
    codes = {Path(v["bundle"]).name: v["exit_code"] for v in doc["verdicts"]}
    assert codes == {"a.kdump": 0, "b.kdump": 2}
    code, out, _ = _cli(["replay", str(folder), "--device", "cpu", "--repeat", "1"], capsys)
    assert code == 2 and "2 replays: 1 clean, 1 failed: exit 2" in out


def test_render_fits_80_columns_and_escapes(tmp_path: Path, capsys) -> None:
    x = torch.randn(16, 8)
    call = capture_call(
        "targets.replay_targets:overread", [x, torch.empty(16, 8)], {}, names=["x", "out"]
    )
    live = input_tensors(call, [x, torch.empty(16, 8)], {})
    attach_outputs(call, live, [1])
    call.target = "targets.replay_targets:overread\x1b[31m"
    save_calls(tmp_path / "r.kdump", [call])
    code, out, _ = _cli(["replay", str(tmp_path / "r.kdump"), "--device", "cpu", "-v"], capsys)
    assert code == ExitCode.CANNOT_RUN  # the escape makes the target unimportable
    assert "\x1b" not in out and "\\x1b" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def _tail_bundle(path: Path, fn: str, produced_tail: torch.Tensor | None) -> Path:
    """A call of `fn` recorded the way `kdump record` records a generic target (x and out both
    recorded as outputs); production read `produced_tail` past the end of x (None: in bounds)."""
    x = torch.randn(256)

    def produce(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(torch.cat([x[4:], produced_tail if produced_tail is not None else x[:4]]) * 2)

    return _one(path, f"targets.replay_targets:{fn}", [x, torch.empty(256)], ["x", "out"],
                [0, 1], produce)  # fmt: skip


def test_cpu_overread_named_with_elements_and_bytes(tmp_path: Path) -> None:
    """The issue's tail.kdump: a read of 4 float32 past x is the verdict (exit 4), with the
    elements and the distance; the production mismatch is its symptom, not a finding."""
    path = _tail_bundle(tmp_path / "tail.kdump", "tail_overread", torch.full((4,), 1e23))
    [v] = replay([path], device="cpu", repeat=3)
    assert v.exit_code == ExitCode.MEMORY_FINDING, v.headline()
    assert [f.kind for f in v.findings] == ["memory"], [f.message for f in v.findings]
    [mem] = v.findings
    assert mem.message.startswith(
        "reads past the end of x: out[252:256] follow the poison after x, 16 bytes"
    )
    assert "symptom: out differs from the recorded output (production) only there" in mem.message
    assert mem.details["tensors"] == ["x"] and mem.details["side"] == "after"
    assert mem.details["bytes"] == 16 and mem.details["outputs"] == ["out[252:256]"]
    assert mem.details["elements"] == 4
    steps = {s.name: s for s in v.steps}
    assert steps["eager/halo differential"].status == "fail"
    assert steps["eager/halo x after"].message == mem.message.split(" (evidence")[0]
    assert "eager/halo x before" not in steps  # only the side read is a step
    # the repeats see the same halos: no nondeterminism
    assert all(s.status == "ok" for s in v.steps if s.name.endswith(" vs run 1"))


def test_cpu_overread_in_the_cli_table_verdict_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _tail_bundle(tmp_path / "tail.kdump", "tail_overread", torch.full((4,), 1e23))
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--device", "cpu"])
    assert exc.value.code == ExitCode.MEMORY_FINDING
    text = " ".join(capsys.readouterr().out.split())
    assert "eager/halo x after FAIL reads past the end of x: out[252:256] follow the poison" in text
    assert "verdict: memory: reads past the end of x: out[252:256]" in text
    assert "(exit 4)" in text
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--device", "cpu", "--json"])
    assert exc.value.code == ExitCode.MEMORY_FINDING
    doc = json.loads(capsys.readouterr().out)
    [verdict] = doc["verdicts"]
    assert doc["exit_code"] == 4 and verdict["exit_code"] == 4
    [mem] = verdict["findings"]
    assert mem["kind"] == "memory" and mem["details"]["bytes"] == 16
    assert mem["details"]["outputs"] == ["out[252:256]"]
    assert verdict["headline"].startswith("memory: reads past the end of x: out[252:256]")


def test_cpu_inbounds_twin_is_clean(tmp_path: Path) -> None:
    path = _tail_bundle(tmp_path / "in.kdump", "tail_inbounds", None)
    [v] = replay([path], device="cpu", repeat=3)
    assert v.exit_code == 0, v.headline()
    step = next(s for s in v.steps if s.name == "eager/halo differential")
    assert step.status == "ok" and "no output element follows the halo poison" in step.message


def test_cpu_read_before_the_start_is_named(tmp_path: Path) -> None:
    x = torch.randn(8, 16)
    path = _one(
        tmp_path / "h.kdump",
        "targets.replay_targets:head_overread",
        [x, torch.empty(8, 16)],
        ["x", "out"],
        [1],
        lambda x, out: out.copy_(torch.cat([torch.zeros(2), x.flatten()[:-2]]).view(8, 16) * 2),
    )
    [v] = replay([path], device="cpu", repeat=1)
    assert v.exit_code == ExitCode.MEMORY_FINDING, v.headline()
    [mem] = v.findings
    assert mem.details["side"] == "before" and mem.details["bytes"] == 8
    assert mem.message.startswith(
        "reads before the start of x: 2 elements of out from out[0, 0] to out[0, 1] follow the "
        "poison before x, 8 bytes"
    )


def test_cpu_overread_named_in_sequence(tmp_path: Path) -> None:
    """A call replayed after the earlier calls of its target (in the same buffers) gets the
    differential too."""
    from targets import replay_targets

    calls = []
    for _ in range(2):
        x = torch.randn(256)
        out = torch.empty(256)
        call = capture_call(
            "targets.replay_targets:tail_overread", [x, out], {}, names=["x", "out"]
        )
        live = input_tensors(call, [x, out], {})
        replay_targets.tail_inbounds(x, out)  # production happened to read finite bytes
        attach_outputs(call, live, [1])
        calls.append(call)
    save_calls(tmp_path / "s.kdump", calls)
    [v] = replay([tmp_path / "s.kdump"], calls=[1], device="cpu", repeat=1)
    assert any(s.name == "eager/call 0 (in sequence)" for s in v.steps)
    assert v.exit_code == ExitCode.MEMORY_FINDING, v.headline()
    assert v.headline().startswith("memory: reads past the end of x: out[252:256]")
    assert [f.kind for f in v.findings] == ["memory"], [f.message for f in v.findings]


def test_cpu_nondeterminism_is_not_an_overread(tmp_path: Path) -> None:
    x = torch.randn(16, 8)
    path = _one(
        tmp_path / "n.kdump",
        "targets.replay_targets:noisy",
        [x, torch.empty(16, 8)],
        ["x", "out"],
        [1],
        lambda x, out: out.copy_(x),
    )
    [v] = replay([path], device="cpu", repeat=3)
    assert "memory" not in {f.kind for f in v.findings}, v.headline()
    step = next(s for s in v.steps if s.name == "eager/halo differential")
    assert step.status == "ok" and "not with the halo poison" in step.message
    assert v.exit_code == ExitCode.MISMATCH


def test_noise_that_follows_the_poison_for_a_while_is_not_an_overread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A last element that changes on the second-poison run, its control, and the first
    single-halo trial (x after), and on no run with the first poison, reads like a halo read
    until the trial repeats: a read follows its poison every time, noise does not."""
    x = torch.randn(16, 8)
    target = "targets.replay_targets:scripted_noise"
    path = _one(tmp_path / "n.kdump", target, [x, torch.empty(16, 8)], ["x", "out"], [1],
                lambda x, out: out.copy_(x))  # fmt: skip
    calls = tmp_path / "calls"
    monkeypatch.setenv("KDUMP_TEST_CALLS", str(calls))
    # runs: 0-2 find the outputs (the recorded values, x probed, out probed), then 3 the first,
    # 4 the second poison, 5-6 the controls, 7 the first trial (x after), 8 the same with the
    # first poison, 9 the trial again
    monkeypatch.setenv("KDUMP_TEST_FLIPS", "4,6,7")
    [v] = replay([path], device="cpu", repeat=1)
    shown = "\n".join(f"{s.name} {s.status} {s.message}" for s in v.steps)
    assert "eager/discover outputs" in {s.name for s in v.steps}, shown
    assert len(calls.read_text().split()) >= 10, shown
    steps = {s.name: s for s in v.steps}
    assert steps["eager/halo differential"].status == "fail", shown
    assert "memory" not in {f.kind for f in v.findings}, shown
    assert "nondeterminism" in steps["eager/halo (every one)"].message, shown
    assert v.exit_code == ExitCode.CLEAN, shown


def test_rows_that_change_at_random_are_not_an_overread(tmp_path: Path) -> None:
    """A kernel whose rows change at random on every run (odds of one half per row, 64 rows)
    passes one round of the single-halo trials with some of its rows by chance; once the
    controls have seen the outputs change, a read has to follow its poison ten rounds in a row."""
    x = torch.randn(64, 8)
    target = "targets.replay_targets:row_lottery"
    path = _one(tmp_path / "r.kdump", target, [x, torch.empty(64, 8)], ["x", "out"], [1],
                lambda x, out: out.copy_(x))  # fmt: skip
    [v] = replay([path], device="cpu", repeat=1)
    shown = "\n".join(f"{s.name} {s.status} {s.message}" for s in v.steps)
    assert "memory" not in {f.kind for f in v.findings}, shown
    steps = {s.name: s for s in v.steps}
    assert steps["eager/halo differential"].status == "fail", shown  # it did look like a read
    assert "nondeterminism" in steps["eager/halo (every one)"].message, shown
    assert v.exit_code == ExitCode.MISMATCH, shown


def test_cpu_overread_without_halo_is_a_mismatch(tmp_path: Path) -> None:
    """--halo 0 places no halo and runs no differential: what remains is the mismatch."""
    path = _tail_bundle(tmp_path / "tail.kdump", "tail_overread", torch.full((4,), 1e23))
    [v] = replay([path], device="cpu", repeat=1, halo=0)
    assert not any("halo" in s.name for s in v.steps)
    assert "memory" not in {f.kind for f in v.findings}


def test_cpu_overread_and_a_wrong_result_elsewhere_are_both_reported(tmp_path: Path) -> None:
    """A mismatch outside the elements read from a halo stays a mismatch finding (exit 4 wins)."""
    x = torch.randn(256)

    def produce(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(torch.cat([x[4:], torch.zeros(4)]) * 2)
        out[0] += 5.0  # production computed element 0 differently

    path = _one(tmp_path / "w.kdump", "targets.replay_targets:tail_overread",
                [x, torch.empty(256)], ["x", "out"], [1], produce)  # fmt: skip
    [v] = replay([path], device="cpu", repeat=1)
    kinds = sorted(f.kind for f in v.findings)
    assert kinds == ["memory", "mismatch"], [f.message for f in v.findings]
    assert v.exit_code == ExitCode.MEMORY_FINDING


class _Replayed:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the same call on the same
    buffers (a graph's pointers are fixed at capture; only memory contents change)."""

    def __init__(self, fn, mc) -> None:
        self.fn, self.mc = fn, mc

    def replay(self) -> None:
        self.fn(*self.mc.args, **self.mc.kwargs)


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph chain on the CPU, in this process: what it does around the capture (halos,
    differential, verdicts) is tested here; the capture itself on the GPU."""
    from kdump.replay import graph

    def capture_graph(s, mc, fn, reset):
        fn(*mc.args, **mc.kwargs)  # the warm-up
        reset()
        return _Replayed(fn, mc)

    monkeypatch.setattr(graph, "capture_graph", capture_graph)
    monkeypatch.setattr(graph, "require_graphs", lambda device: None)


def test_graph_chain_names_overread_at_eager_and_every_replay(
    tmp_path: Path, cpu_graphs: None
) -> None:
    path = _tail_bundle(tmp_path / "tail.kdump", "tail_overread", torch.full((4,), 1e23))
    other = _tail_bundle(tmp_path / "next.kdump", "tail_overread", torch.full((4,), 7.0))
    [v] = replay([path], mode="graph", device="cpu", isolate=False, then=(f"{other}:0",))
    steps = "\n".join(f"{st.name} {st.status} {st.message}" for st in v.steps)
    assert v.exit_code == ExitCode.MEMORY_FINDING, f"{v.headline()}\n{steps}"
    # one finding for the one over-read, however many replays show it
    assert [f.kind for f in v.findings] == ["memory"], [f.message for f in v.findings]
    assert v.findings[0].step == "graph/eager"
    assert v.headline().startswith(
        "memory: reads past the end of x: out[252:256] follow the poison after x, 16 bytes"
    )
    by_name = {st.name: st for st in v.steps}
    for step in ("graph/eager", "graph/replay identical", "graph/replay 1 (recorded next.kdump:0)"):
        assert by_name[f"{step}/halo x after"].status == "fail", steps
        assert by_name[f"{step}/halo x after"].message.endswith("16 bytes")
    # the replay against the eager run and the fresh oracle agree: the same poison was read
    assert by_name["graph/replay identical vs eager"].status == "ok", steps
    assert by_name["graph/replay identical vs fresh eager"].status == "ok", steps


def test_graph_chain_inbounds_and_atomics_stay_clean(tmp_path: Path, cpu_graphs: None) -> None:
    for path in (
        _tail_bundle(tmp_path / "in.kdump", "tail_inbounds", None),
        _rowsum_bundle(tmp_path / "a.kdump"),
    ):
        [v] = replay([path], mode="graph", device="cpu", isolate=False)
        assert v.exit_code == 0, v.headline()
        diffs = [st for st in v.steps if st.name.endswith("/halo differential")]
        assert len(diffs) == 3 and all(st.status == "ok" for st in diffs), diffs


def test_where_names_the_elements_read() -> None:
    from kdump.replay.overreads import where

    m = torch.zeros(256, dtype=torch.bool)
    m[252:] = True
    assert where("out", m) == "out[252:256]"
    m[100] = True
    assert where("out", m) == "5 elements of out in out[100:256]"
    rows = torch.zeros(64, 32, dtype=torch.bool)
    rows[56:] = True
    assert where("out", rows) == "out[56:64]"
    rows[:] = False
    rows[63, 30:] = True
    assert where("out", rows) == "2 elements of out from out[63, 30] to out[63, 31]"


def test_differs_follows_the_tolerance_policy() -> None:
    from kdump.replay.overreads import differs

    a = torch.randn(64) * 100
    noisy = a * (1 + 1e-7 * torch.randn(64))  # reordered sums: not a read
    assert not differs(a, noisy, None).any()
    b = a.clone()
    b[-4:] = 1.3e7  # the second poison read into one run cannot widen the tolerance
    assert differs(a, b, None).nonzero().flatten().tolist() == [60, 61, 62, 63]
    n = a.clone()
    n[3] = float("nan")
    m = n.clone()
    m.view(torch.int32)[3] = -1  # another NaN payload: still NaN in both
    assert not differs(n, m, None).any()
    mask = torch.ones(64, dtype=torch.bool)
    mask[60:] = False
    assert not differs(a, b, mask).any()  # elements the spec does not judge
    i = torch.arange(8)
    j = i.clone()
    j[7] = 0x40404040
    assert differs(i, j, None).nonzero().flatten().tolist() == [7]
