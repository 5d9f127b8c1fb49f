"""`kdump slim`: each tier on a bundle of DeepGEMM's contiguous call (planted wrong builds from
tests/targets/planted_*/, replayed with --backend library against the torch reference), sizes,
the stop message, --keep, refusals; and on a GPU, the packaged kernel's fault variant."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, load_bundle, save_calls
from kdump.cli import main
from kdump.errors import ExitCode, UntrustedTargetError, UsageError
from kdump.format.records import Source
from kdump.kernels.registry import spec_for
from kdump.replay import replay
from kdump.replay.options import ReplayOptions
from kdump.report.slim import SlimOptions, slim

TESTS = Path(__file__).resolve().parent
TARGET = "deep_gemm:m_grouped_fp8_fp4_gemm_nt_contiguous"
NAMES = ["a", "b", "d", "grouped_layout"]
SIZES = [37, 100, 0, 64, 16, 91]  # one group without tokens; -1 padding up to 128 rows each
CPU = ReplayOptions(backend="library", device="cpu", repeat=1)


def _planted(monkeypatch: pytest.MonkeyPatch, bug: str) -> Any:
    """Put the planted DeepGEMM build `bug` first on the path, here and in replay children."""
    folder = str(TESTS / "targets" / f"planted_{bug}")
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.syspath_prepend(folder)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([folder, str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    import sys

    sys.modules.pop("deep_gemm", None)
    import deep_gemm

    return deep_gemm


def _bundle(path: Path, fn: Any, zero_row: int | None = None) -> Path:
    """A recorded call of `fn` (fp32 scales, so the scales are floating-point data), its output
    recorded after the call as production would."""
    spec = spec_for(TARGET)
    args, kwargs = spec.generate(seed=3, num_groups=6, group_sizes=SIZES, scale_format="fp32")
    if zero_row is not None:
        args[0][0][zero_row].zero_()  # a row of a group whose bytes are all zero
    call = capture_call(TARGET, args, kwargs, names=NAMES)
    live = input_tensors(call, args, kwargs)
    fn(*args, **kwargs)
    attach_outputs(call, live, [4])  # tensors: a, sfa, b, sfb, d, grouped_layout
    return save_calls(path, [call])


def _sources(path: Path) -> dict[str, Source]:
    c = load_bundle(path).calls[0]
    return {n: c.storages[t.storage].source for n, t in zip(c.tensor_names, c.tensors)}


def test_every_tier_holds_for_a_routing_bug(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dg = _planted(monkeypatch, "routing")
    src = _bundle(tmp_path / "big.kdump", dg.m_grouped_fp8_gemm_nt_contiguous)
    seen: list[tuple[str, int, int]] = []
    r = slim(
        src,
        tmp_path / "small.kdump",
        SlimOptions(replay=CPU, seed=11),
        lambda label, done, total: seen.append((label, done, total)),
    )
    assert (r.finding_kind, r.finding_step) == ("mismatch", "eager/run 1")
    assert [t.held for t in r.tiers] == [True, True, True]
    assert r.stopped_at == 3 and r.reason == "every tier kept the failure"
    sizes = [r.original_nbytes, *(t.nbytes for t in r.tiers)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4
    assert r.ratio >= 20, sizes
    assert [d for _, d, _ in seen] == [0, 1, 2, 3, 4] and {t for *_, t in seen} == {4}

    small = load_bundle(tmp_path / "small.kdump")
    orig = load_bundle(src).calls[0]
    call = small.calls[0]
    assert not call.has_outputs  # tier 2 on: the recorded outputs no longer belong
    assert [(t.dtype, t.shape, t.stride, t.storage_offset) for t in call.tensors] == [
        (t.dtype, t.shape, t.stride, t.storage_offset) for t in orig.tensors
    ]
    assert _sources(tmp_path / "small.kdump") == {
        "a[0]": Source.SYNTHETIC,
        "a[1]": Source.SYNTHETIC,
        "b[0]": Source.SYNTHETIC,
        "b[1]": Source.SYNTHETIC,
        "d": Source.SYNTHETIC,
        "grouped_layout": Source.BLOB,  # routing stays exact
    }
    assert torch.equal(call.args[3], orig.args[3])
    assert set(call.synthesized) == {"a[0]", "a[1]", "b[0]", "b[1]", "d"}
    info = small.info["slim"]
    assert info["tier"] == 3 and info["seed"] == 11 and info["from"] == "big.kdump"
    tier3 = info["tiers"][2]
    assert {r["how"] for r in tier3["replaced"]} == {"synthetic"}
    assert all(isinstance(r["seed"], int) for r in tier3["replaced"])
    # The slim bundle replays to the same finding, from the reference, on its own.
    [v] = replay([tmp_path / "small.kdump"], CPU)
    assert any(f.kind == "mismatch" and f.details.get("oracle") == "reference" for f in v.findings)
    # `kdump info` says how each storage is held.
    from kdump.bundle.inspect import describe_bundle

    held = {t["name"]: t["source"] for t in describe_bundle(small)["calls"][0]["tensors"]}
    assert held["grouped_layout"] == "blob" and held["b[0]"] == "synthetic", held
    # Expanding it is deterministic: the same bytes twice.
    again = load_bundle(tmp_path / "small.kdump").calls[0].materialize("cpu").materialized
    for x, y in zip(call.materialize("cpu").materialized.allocations, again.allocations):
        assert torch.equal(x.span, y.span)


def test_tier_1_drops_only_rows_the_call_cannot_touch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dg = _planted(monkeypatch, "routing")
    src = _bundle(tmp_path / "big.kdump", dg.m_grouped_fp8_gemm_nt_contiguous)
    r = slim(src, tmp_path / "t1.kdump", SlimOptions(replay=CPU, max_tier=1))
    assert [t.held for t in r.tiers] == [True] and r.stopped_at == 1
    call = load_bundle(tmp_path / "t1.kdump").calls[0]
    orig = load_bundle(src).calls[0]
    assert call.has_outputs  # tier 1 keeps the recorded outputs
    kinds = _sources(tmp_path / "t1.kdump")
    assert kinds["a[0]"] is kinds["b[0]"] is Source.SPARSE
    assert kinds["grouped_layout"] is kinds["d"] is Source.BLOB
    labels = orig.args[3]
    a, b = call.args[0][0], call.args[1][0]
    a0, b0 = orig.args[0][0], orig.args[1][0]
    valid = labels >= 0
    assert torch.equal(a.view(torch.uint8)[valid], a0.view(torch.uint8)[valid])
    assert not a.view(torch.uint8)[~valid].any()  # padding rows: zero
    assert not b.view(torch.uint8)[2].any()  # the group without tokens: zero
    others = [g for g in range(6) if g != 2]
    assert torch.equal(b.view(torch.uint8)[others], b0.view(torch.uint8)[others])
    sfa, sfa0 = call.args[0][1], orig.args[0][1]
    assert torch.equal(sfa[valid], sfa0[valid])
    held = r.tiers[0].replaced
    assert {x.how for x in held} == {"sparse"}
    assert sum(x.held_bytes for x in held) < sum(orig.storages[x.storage].span_nbytes for x in held)


def test_a_data_dependent_bug_stops_at_tier_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dg = _planted(monkeypatch, "zero_rows")
    src = _bundle(tmp_path / "big.kdump", dg.m_grouped_fp8_gemm_nt_contiguous, zero_row=5)
    r = slim(src, tmp_path / "small.kdump", SlimOptions(replay=CPU))
    assert [t.held for t in r.tiers] == [True, False]
    assert r.stopped_at == 1
    assert r.reason.startswith("tier 2 (synthetic activations and scales) lost the failure")
    assert _sources(tmp_path / "small.kdump")["a[0]"] is Source.SPARSE  # the last that held
    info = load_bundle(tmp_path / "small.kdump").info["slim"]
    assert info["tier"] == 1 and [t["held"] for t in info["tiers"]] == [True, False]


def test_keep_protects_an_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dg = _planted(monkeypatch, "routing")
    src = _bundle(tmp_path / "big.kdump", dg.m_grouped_fp8_gemm_nt_contiguous)
    r = slim(src, tmp_path / "small.kdump", SlimOptions(replay=CPU, keep=("b", "a[1]")))
    kinds = _sources(tmp_path / "small.kdump")
    assert kinds["b[0]"] is kinds["b[1]"] is kinds["a[1]"] is Source.BLOB
    assert kinds["a[0]"] is Source.SYNTHETIC
    assert r.tiers[2].held is None and r.tiers[2].headline == "nothing to replace"
    with pytest.raises(UsageError, match="names no tensor argument"):
        slim(src, tmp_path / "x.kdump", SlimOptions(replay=CPU, keep=("weights",)))


def test_a_failure_seen_only_against_the_recording_stops_before_tier_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dg = _planted(monkeypatch, "routing")
    src = _bundle(tmp_path / "big.kdump", dg.m_grouped_fp8_gemm_nt_contiguous)
    # Replayed on the reference itself, only the recorded (wrong) output disagrees.
    ref = ReplayOptions(backend="reference", device="cpu", repeat=1)
    r = slim(src, tmp_path / "small.kdump", SlimOptions(replay=ref))
    assert [t.held for t in r.tiers] == [True, None]
    assert r.stopped_at == 1 and "only seen against them" in r.reason


def test_clean_and_untrusted_originals_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = spec_for(TARGET)
    args, kwargs = spec.generate(seed=1, num_groups=2, group_sizes=[10, 20], scale_format="fp32")
    src = save_calls(tmp_path / "ok.kdump", [capture_call(TARGET, args, kwargs, names=NAMES)])
    ref = ReplayOptions(backend="reference", device="cpu", repeat=1)
    with pytest.raises(UsageError, match="nothing to reproduce"):
        slim(src, tmp_path / "s.kdump", SlimOptions(replay=ref))
    assert not (tmp_path / "s.kdump").exists()
    with pytest.raises(UsageError, match="overwrite"):
        slim(src, src, SlimOptions(replay=ref))
    evil = save_calls(tmp_path / "e.kdump", [capture_call("os:system", ["true"], {})])
    with pytest.raises(UntrustedTargetError):
        slim(evil, tmp_path / "s.kdump", SlimOptions(replay=ref))


def test_cli_prints_each_tier_and_why_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dg = _planted(monkeypatch, "zero_rows")
    src = _bundle(tmp_path / "big.kdump", dg.m_grouped_fp8_gemm_nt_contiguous, zero_row=5)
    out = tmp_path / "small.kdump"
    argv = ["slim", str(src), "-o", str(out), "--backend", "library", "--device", "cpu"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--repeat", "1"])
    text = capsys.readouterr().out
    assert exc.value.code == 0
    lines = text.splitlines()
    assert lines[0].startswith("original: call 0, ") and "mismatch" in lines[0]
    assert lines[1].startswith("tier 1 (drop untouched rows (sparse)): ") and "held" in lines[1]
    assert lines[2].startswith("tier 2 (synthetic activations and scales): ")
    assert "verdict LOST" in lines[2]
    assert lines[3].startswith("stopped at tier 1 because tier 2 (synthetic activations")
    assert "x smaller)" in lines[3]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--repeat", "1", "--max-tier", "1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert exc.value.code == 0 and doc["stopped_at"] == 1 and doc["ratio"] > 1
    clean = save_calls(
        tmp_path / "c.kdump",
        [capture_call("targets.nothing:f", [torch.zeros(3)], {})],
    )
    with pytest.raises(SystemExit) as exc:
        main(["slim", str(clean), "-o", str(tmp_path / "x.kdump")])
    assert exc.value.code == ExitCode.USAGE
    assert "no kernel plug-in's" in capsys.readouterr().err


FAULTY = "kdump.kernels.sm120.faulty:m_grouped_fp8_gemm_nt_contiguous"


@pytest.mark.gpu
def test_gpu_faulty_kernel_slims_20x_and_still_fails_in_graph_mode(tmp_path: Path) -> None:
    """The packaged kernel's fault variant (a stale per-buffer schedule), recorded under
    kdump.recording: its graph-mode failure survives every tier, at a twentieth of the size."""
    import kdump
    from kdump.kernels.sm120 import faulty

    spec = spec_for("deep_gemm:m_grouped_fp8_gemm_nt_contiguous")
    args, kwargs = spec.generate(
        seed=5, device="cuda", num_groups=8, n=512, k=1024, expected_m=100, scale_format="ue8m0"
    )
    with kdump.recording(FAULTY, out=tmp_path / "dumps", mode="sync") as rec:
        faulty.m_grouped_fp8_gemm_nt_contiguous(*args, **kwargs)
        torch.cuda.synchronize()
    [src] = rec.written
    graph = ReplayOptions(mode="graph", backend="packaged-faulty")
    [v0] = replay([src], graph)
    assert v0.findings, v0.headline()
    r = slim(src, tmp_path / "small.kdump", SlimOptions(replay=graph))
    print(r.to_json())
    assert r.stopped_at == 3 and all(t.held for t in r.tiers), r.reason
    assert r.ratio >= 20, (r.original_nbytes, r.nbytes)
    [v] = replay([tmp_path / "small.kdump"], graph)
    assert any(f.kind == r.finding_kind and f.step == r.finding_step for f in v.findings)


def _thinned(path: Path) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """The call of a sample capture and its input tensors before and after tier 1's plan."""
    from dataclasses import replace

    from kdump.report.slim import touched_ranges

    bundle = load_bundle(path)
    call = bundle.calls[0]
    plan = touched_ranges(bundle)
    assert plan, "tier 1 found nothing to drop"
    storages = list(call.storages)
    for j, ranges in plan.items():
        storages[j] = replace(storages[j], source=Source.SPARSE, ranges=tuple(ranges))

    spans = []
    for j, st in enumerate(storages):
        full = bundle.read_blob(call.storages[j].blob)
        if st.source is Source.SPARSE:
            out = torch.zeros_like(full)
            for b, e in st.ranges:
                out[b:e] = full[b:e]
            spans.append(out)
        else:
            spans.append(full)
    from kdump.bundle.materialize import materialize

    thin = materialize(storages, call.tensors, spans.__getitem__).tensors
    return call, call.materialize("cpu").tensors, thin


def test_tier_1_plan_for_the_masked_layout() -> None:
    call, full, thin = _thinned(TESTS.parent / "captures" / "masked_ue8m0.kdump")
    names = call.tensor_names
    a, a0 = thin[names.index("a[0]")], full[names.index("a[0]")]
    masked_m = full[names.index("masked_m")]
    rows = torch.arange(a.shape[1]).unsqueeze(0) < masked_m.unsqueeze(1)
    assert torch.equal(a.view(torch.uint8)[rows], a0.view(torch.uint8)[rows])
    assert not a.view(torch.uint8)[~rows].any()
    b, b0 = thin[names.index("b[0]")], full[names.index("b[0]")]
    for g, m in enumerate(masked_m.tolist()):
        assert torch.equal(b[g].view(torch.uint8), b0[g].view(torch.uint8)) == (m > 0)


def test_tier_1_plan_for_the_psum_layout() -> None:
    from kdump.kernels.deepgemm.reference import psum_row_mask

    call, full, thin = _thinned(TESTS.parent / "captures" / "contiguous_psum_fp32.kdump")
    names = call.tensor_names
    a, a0 = thin[names.index("a[0]")], full[names.index("a[0]")]
    ends = full[names.index("grouped_layout")]
    rows = psum_row_mask(ends, 128, a.shape[0])
    assert not rows.all() and rows.any()
    assert torch.equal(a.view(torch.uint8)[rows], a0.view(torch.uint8)[rows])
    assert not a.view(torch.uint8)[~rows].any()
    sfa, sfa0 = thin[names.index("a[1]")], full[names.index("a[1]")]
    assert torch.equal(sfa[rows], sfa0[rows])  # MN-major scales: the touched elements only


def test_hostile_slim_requests_are_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    from kdump.bundle.manifest import call_entries as _entries
    from kdump.bundle.writer import save_entries

    src = TESTS.parent / "captures" / "contiguous_ue8m0.kdump"
    for opts, needle in [
        (SlimOptions(seed=1 << 64), "seed"),
        (SlimOptions(seed=-1), "seed"),
        (SlimOptions(max_tier=4), "max tier"),
    ]:
        with pytest.raises(UsageError, match=needle):
            slim(src, tmp_path / "s.kdump", opts)
    with pytest.raises(UsageError, match="names no tensor argument"):
        slim(src, tmp_path / "s.kdump", SlimOptions(replay=CPU, keep=("nope",)))
    # The writer of rewritten records checks that every blob holds what its name says.
    rec = capture_call("m:f", [torch.arange(8.0)], {})
    [entry] = _entries([rec], ["a" * 64])
    with pytest.raises(UsageError, match="not given"):
        save_entries(tmp_path / "w.kdump", [entry], {})
    with pytest.raises(UsageError, match="does not hold"):
        save_entries(tmp_path / "w.kdump", [entry], {"a" * 64: b"x" * 32})
    ok = replace(entry.storages[0], blob=hashlib.sha256(b"y" * 32).hexdigest())
    path = save_entries(
        tmp_path / "w.kdump", [replace(entry, storages=(ok,))], {ok.blob: b"y" * 32}
    )
    assert load_bundle(path).calls[0].args[0].view(torch.uint8).tolist() == [ord("y")] * 32


def test_every_call_of_a_bundle_is_slimmed_and_shared_weights_stay_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dg = _planted(monkeypatch, "routing")
    spec = spec_for(TARGET)
    args, kwargs = spec.generate(seed=4, num_groups=6, group_sizes=SIZES, scale_format="fp32")
    calls = []
    for step in range(2):
        if step:
            labels = args[3]
            labels[labels == 5] = -1  # a later batch: group 5 got no tokens
        call = capture_call(TARGET, args, kwargs, names=NAMES)
        live = input_tensors(call, args, kwargs)
        dg.m_grouped_fp8_gemm_nt_contiguous(*args, **kwargs)
        attach_outputs(call, live, [4])
        calls.append(call)
    src = save_calls(tmp_path / "two.kdump", calls)
    r = slim(src, tmp_path / "small.kdump", SlimOptions(replay=CPU, call=1))
    assert r.call == 1 and r.stopped_at == 3 and all(t.held for t in r.tiers)
    small = load_bundle(tmp_path / "small.kdump")
    assert len(small.calls) == 2
    first, second = (c.storages for c in small.calls)
    b = small.calls[0].tensor_names.index("b[0]")
    sb = small.calls[0].tensors[b].storage
    assert first[sb].source is Source.SYNTHETIC and first[sb] == second[sb]  # one weight
    assert {x.call for x in r.tiers[0].replaced} == {0, 1}
    # Tier 1 dropped group 5's weights only in the call where it had no tokens.
    t1 = {(x.call, x.tensors): x.held_bytes for x in r.tiers[0].replaced}
    assert t1[(1, ("b[0]",))] < t1[(0, ("b[0]",))]


def test_standalone_script_runs_slimmed_bundles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repro script (no kdump) reads sparse and synthetic storages: a tier-1 bundle still
    matches its recorded output, a tier-3 one runs on generated data and says so."""
    import subprocess
    import sys

    from kdump.report.script import render_script

    dg = _planted(monkeypatch, "routing")
    src = _bundle(tmp_path / "big.kdump", dg.m_grouped_fp8_gemm_nt_contiguous)
    folder = str(TESTS / "targets" / "planted_routing")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    for tier in (1, 3):
        small = tmp_path / f"tier{tier}.kdump"
        slim(src, small, SlimOptions(replay=CPU, seed=5, max_tier=tier))
        script = tmp_path / f"repro{tier}.py"
        script.write_text(render_script(str(small)), encoding="utf-8")
        proc = subprocess.run(
            # the planted build calls kdump's reference: its checkout goes on the path (on a
            # machine where kdump is only on PYTHONPATH, -I would hide it); --device cpu, as slim
            # ran, so a GPU machine prints the same lines
            [
                sys.executable,
                "-I",
                str(script),
                "--path",
                folder,
                "--path",
                str(TESTS),
                "--path",
                str(TESTS.parent),
                "--device",
                "cpu",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        if tier == 1:
            assert "outputs match the recorded ones" in out, out
        else:
            assert "(synthetic) generated by splitmix64-ih4" in out, out
