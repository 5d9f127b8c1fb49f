"""Eager replay of DeepGEMM-spec bundles on the CPU reference: the README's main job, altered
outputs, contract violations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, load_bundle, save_calls
from kdump.errors import ExitCode
from kdump.kernels.registry import spec_for
from kdump.replay import replay

CAPTURES = Path(__file__).parents[1] / "captures"
SPEC_ID = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"


@pytest.mark.parametrize("name", ["contiguous_ue8m0", "contiguous_fp32", "masked_ue8m0"])
def test_sample_captures_replay_clean(name: str) -> None:
    [v] = replay([CAPTURES / f"{name}.kdump"], device="cpu")
    assert v.exit_code == 0, v.headline()
    assert v.backend == "reference"
    assert any(s.name == "eager/run 1 vs recorded" and s.status == "ok" for s in v.steps)


def _rerecord(src: Path, dst: Path, alter: tuple[int, int] | None) -> None:
    """Copy a capture's call, optionally altering one element of its recorded output."""
    call = load_bundle(src).calls[0]
    args, kwargs = call.args, call.kwargs
    rec = capture_call(
        call.target, args, kwargs, called_as=call.called_as, names=call.names, meta=call.meta
    )
    live = input_tensors(rec, args, kwargs)
    outputs = call.materialize_outputs("cpu")
    for i, value in outputs.items():
        live[i].copy_(value)
        if alter is not None:
            live[i][alter] = live[i][alter] * 3 + 1
    attach_outputs(rec, live, list(outputs))
    save_calls(dst, [rec], env=load_bundle(src).env)


def test_altered_recorded_output_is_a_mismatch_naming_the_element(tmp_path: Path) -> None:
    src = CAPTURES / "contiguous_ue8m0.kdump"
    call = load_bundle(src).calls[0]
    spec = spec_for(call.target, call.names)
    bound = spec.bind(call.args, call.kwargs)
    row = int(spec.meaningful(bound, "d").reshape(-1).nonzero()[5])  # a meaningful row
    bad = tmp_path / "altered.kdump"
    _rerecord(src, bad, (row, 17))
    [v] = replay([bad], device="cpu")
    assert v.exit_code == ExitCode.MISMATCH
    f = next(f for f in v.findings if f.kind == "mismatch")
    assert f"[{row}, 17]" in f.message


def _violating(tmp_path: Path, how: str) -> Path:
    spec = spec_for(SPEC_ID)
    args, kwargs = spec.generate(
        seed=2, num_groups=4, n=256, k=512, expected_m=40, scale_format="fp32"
    )
    layout = args[3]
    if how == "label":
        layout[layout.argmax()] = 4  # label == G
    else:
        first = int((layout >= 0).nonzero()[0])
        g = int(layout[first])
        layout[first : first + 1] = -1  # the group now starts one row late: misaligned
        assert int(layout[first + 1]) == g
    path = tmp_path / f"{how}.kdump"
    save_calls(path, [capture_call(spec.id, args, kwargs, names=spec.param_names())])
    return path


@pytest.mark.parametrize("how", ["label", "misaligned"])
def test_contract_violation_launches_nothing(tmp_path: Path, how: str) -> None:
    [v] = replay([_violating(tmp_path, how)], device="cpu")
    assert v.exit_code == ExitCode.CONTRACT, v.headline()
    assert not any(s.name.startswith("eager/run") for s in v.steps)
    [forced] = replay([_violating(tmp_path, how)], device="cpu", force=True, repeat=1)
    assert any(s.name.startswith("eager/run") for s in forced.steps)


def test_alias_recorded_call_replays(tmp_path: Path) -> None:
    """A call recorded under an alias resolves to the same spec and replays."""
    spec = spec_for("deep_gemm:m_grouped_fp8_fp4_gemm_nt_contiguous")
    assert spec.id == SPEC_ID
    args, kwargs = spec.generate(seed=4, num_groups=3, n=128, k=256, expected_m=30)
    torch.manual_seed(0)
    path = tmp_path / "alias.kdump"
    save_calls(
        path,
        [
            capture_call(
                spec.id,
                args,
                kwargs,
                names=spec.param_names(),
                called_as="deep_gemm.m_grouped_fp8_fp4_gemm_nt_contiguous",
            )
        ],
    )
    [v] = replay([path], device="cpu", repeat=1)
    assert v.exit_code == 0, v.headline()


STANDINS = Path(__file__).parent / "standins"


@pytest.fixture
def standin_deep_gemm(monkeypatch: pytest.MonkeyPatch):
    """The stand-in DeepGEMM, importable here and in replay children; its state restored."""
    import sys

    from kdump.kernels.deepgemm import state as deepgemm_state

    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.setenv("PYTHONPATH", str(STANDINS))
    for m in ("deep_gemm", "deep_gemm._C", "dg_inputs"):
        sys.modules.pop(m, None)
    deepgemm_state.reset()
    import deep_gemm._C as C

    saved = dict(C._STATE)
    yield deep_gemm_module()
    C._STATE.clear()
    C._STATE.update(saved)
    deepgemm_state.reset()
    for m in ("deep_gemm", "deep_gemm._C", "dg_inputs"):
        sys.modules.pop(m, None)


def deep_gemm_module():
    import deep_gemm

    return deep_gemm


def _record_after(dg, tmp_path: Path, **setters: object) -> Path:
    """Record one contiguous call with 64-row groups after calling DeepGEMM's setters."""
    from dg_inputs import make_contiguous

    import kdump

    with kdump.recording("deep_gemm", out=tmp_path) as rec:
        for name, value in setters.items():
            getattr(dg, name)(value)
        a, b, d, layout = make_contiguous(3, groups=4, m_per_group=64)
        dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout)
    [path] = rec.written
    return Path(path)


def test_setter_recorded_alignment_is_reapplied(standin_deep_gemm, tmp_path: Path) -> None:
    from kdump.cli import main

    path = _record_after(standin_deep_gemm, tmp_path, set_mk_alignment_for_contiguous_layout=64)
    # Without the setting the same call breaks the default 128-row alignment.
    call = load_bundle(path).calls[0]
    bound = spec_for(call.target).bind(call.args, call.kwargs)
    assert spec_for(call.target).validate(bound)
    [v] = replay([path], backend="reference", device="cpu")
    assert v.exit_code == ExitCode.CLEAN, v.headline()
    assert any("mk_alignment=64" in n for n in v.notes), v.notes
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(path), "--backend", "reference", "--device", "cpu"])
    assert exc.value.code == 0


def test_setting_invalid_here_is_noted_not_applied(
    standin_deep_gemm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import deep_gemm._C as C

    from kdump.kernels.deepgemm import plugin as dg_plugin

    path = _record_after(
        standin_deep_gemm, tmp_path, set_num_sms=500, set_mk_alignment_for_contiguous_layout=64
    )
    C._STATE.update(num_sms=132, mk_alignment=128)
    # This "device" has 132 SMs: the recorded 500 cannot be applied (in-process replay).
    monkeypatch.setattr(dg_plugin, "_sm_count", lambda device: 132)
    [v] = replay([path], backend="reference", device="cpu", isolate=False)
    assert v.exit_code == ExitCode.CLEAN, v.headline()
    assert any("num_sms=500 not applied: this GPU has 132 SMs" in n for n in v.notes), v.notes
    assert C._STATE["num_sms"] == 132  # the library was loaded here and kept its value
    assert C._STATE["mk_alignment"] == 64  # the valid setting was re-applied to the library
    applied = [n for n in v.notes if "applied to the library and the contract" in n]
    assert len(applied) == 1 and "mk_alignment=64" in applied[0] and "num_sms" not in applied[0]
