"""`kdump replay --bisect`: kdump's exit codes mapped onto `git bisect run`'s (0 good, 1 bad,
125 skip, 128 abort), through the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls
from kdump.cli import main
from kdump.errors import ExitCode, bisect_exit_code

TARGETS = Path(__file__).parent
CAPTURES = Path(__file__).parent.parent / "captures"


@pytest.fixture(autouse=True)
def _child_can_import_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(TARGETS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TARGETS), os.environ.get("PYTHONPATH", "")])
    )
    (tmp_path / "kdump.toml").write_text('allow-targets = ["targets.*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "kdump.toml"))


def _record(path: Path, *, corrupt: bool) -> Path:
    from targets import replay_targets

    x = torch.randn(16, 8, device="cpu")
    out = torch.empty(16, 8, device="cpu")
    call = capture_call("targets.replay_targets:scale_into", [x, out], {}, names=["x", "out"])
    live = input_tensors(call, [x, out], {})
    replay_targets.scale_into(x, out)
    attach_outputs(call, live, [1])
    if corrupt:
        call.outputs.data[0][4 * (2 * 8 + 1) + 2] ^= 0x40  # a high mantissa bit of out[2, 1]
    save_calls(path, [call])
    return path


def _exit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_mapping_covers_every_exit_code() -> None:
    expected = {0: 0, 1: 1, 2: 128, 3: 1, 4: 1, 5: 1, 70: 128, 125: 125}
    assert {int(c): bisect_exit_code(c) for c in ExitCode} == expected
    assert bisect_exit_code(99) == 128  # a code kdump never documents aborts


def test_clean_is_good(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _record(tmp_path / "good.kdump", corrupt=False)
    assert _exit(capsys, "replay", str(good), "--device", "cpu")[0] == 0
    code, _, err = _exit(capsys, "replay", str(good), "--device", "cpu", "--bisect")
    assert code == 0 and "exit 0 -> 0" in err


def test_mismatch_is_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _record(tmp_path / "bad.kdump", corrupt=True)
    code, out, _ = _exit(capsys, "replay", str(bad), "--device", "cpu", "--bisect", "--json")
    assert code == 1
    rep = json.loads(out)
    assert rep["exit_code"] == 1 and rep["verdicts"][0]["findings"][0]["kind"] == "mismatch"


def test_bad_bundle_aborts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.kdump"
    broken.write_bytes(os.urandom(256))
    assert _exit(capsys, "replay", str(broken))[0] == 2
    code, _, err = _exit(capsys, "replay", str(broken), "--bisect")
    assert code == 128 and "kdump: error:" in err
    code, out, _ = _exit(capsys, "replay", str(broken), "--bisect", "--json")
    assert code == 128 and json.loads(out)["exit_code"] == 2


def test_rejected_command_line_aborts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _record(tmp_path / "good.kdump", corrupt=False)
    assert _exit(capsys, "replay", str(good), "--repeat", "0")[0] == 2
    code, _, err = _exit(capsys, "replay", str(good), "--repeat", "0", "--bisect")
    assert code == 128 and "--repeat" in err


def test_internal_error_aborts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kdump.replay

    def broken(*args: object, **kwargs: object) -> list:
        raise RuntimeError("a bug in kdump")

    monkeypatch.setattr(kdump.replay, "replay", broken)
    good = _record(tmp_path / "good.kdump", corrupt=False)
    assert _exit(capsys, "replay", str(good))[0] == 70
    code, _, err = _exit(capsys, "replay", str(good), "--bisect")
    assert code == 128 and "a bug in kdump" in err


def test_library_missing_is_skip(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import deep_gemm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("deep_gemm is importable here: the skip case needs it missing")
    bundle = str(CAPTURES / "contiguous_ue8m0.kdump")
    assert _exit(capsys, "replay", bundle, "--backend", "deep_gemm")[0] == 125
    code, _, err = _exit(capsys, "replay", bundle, "--backend", "deep_gemm", "--bisect")
    assert code == 125 and "exit 125 -> 125" in err
