"""Hints that work as printed (report, slim, doctor, the pytest plugin) and the smaller things a
user trips on: redaction of flight-recorder hosts, multi-line meta as code blocks, group ids that
read as ids, slim's size wording and -q, doctor's lines."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kdump
from kdump.bundle import capture_call, save_calls
from kdump.cli import main
from kdump.doctor import diagnose, importable_at_replay, replay_words, tidy
from kdump.pytest_plugin import outcome, refusal
from kdump.replay.options import ReplayOptions
from kdump.replay.verdict import Finding, Verdict
from kdump.report.slim import size_change

ROOT = Path(__file__).resolve().parent.parent
CAPTURES = ROOT / "captures"
MODULE = "kd_user_scale_mod"  # a module of the user's own, importable only with --path
TARGET = f"{MODULE}:scale"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


@pytest.fixture
def user_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A bundle of a target in the user's own folder (src/), recorded with its output:
    (bundle, src)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{MODULE}.py").write_text("def scale(x, out):\n    out.copy_(x * 2)\n")
    monkeypatch.syspath_prepend(str(src))
    import importlib

    mod = importlib.import_module(MODULE)
    x, out = torch.arange(8, dtype=torch.float32), torch.empty(8)
    path = tmp_path / "mine.kdump"
    kdump.dump_call(path, mod.scale, x, out)
    sys.modules.pop(MODULE, None)
    return path, src


def _commands(md: str) -> list[str]:
    block = md.split("## Reproduce", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line.strip()]


def _run_printed(capsys: pytest.CaptureFixture[str], line: str) -> tuple[int, str, str]:
    words = shlex.split(line)
    assert words[0] == "kdump", line
    return run(capsys, *words[1:])


# --- next lines and hints that work as printed ----------------------------------------------


def test_importable_at_replay_uses_the_replay_environment(user_bundle: tuple[Path, Path]) -> None:
    _, src = user_bundle
    assert not importable_at_replay(MODULE)  # not on the replay child's path ...
    assert importable_at_replay(MODULE, [str(src)])  # ... unless --path names its folder
    assert importable_at_replay("json") and importable_at_replay("torch.nn")


def test_replay_words_allow_unclaimed_targets_only(user_bundle: tuple[Path, Path]) -> None:
    _, src = user_bundle
    words, missing = replay_words([TARGET, TARGET, "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"])
    assert words == ["--allow-target", TARGET] and missing == [MODULE]
    words, missing = replay_words([TARGET], paths=[str(src)])
    assert words == ["--allow-target", TARGET, "--path", str(src)] and missing == []
    # a name no one would allow is never echoed into a command (the replay refuses it itself)
    assert replay_words(["mod:evil\x1b[31m<script>", "os:system;rm"]) == ([], [])


def test_report_commands_work_as_printed(
    capsys: pytest.CaptureFixture[str], user_bundle: tuple[Path, Path], tmp_path: Path
) -> None:
    bundle, src = user_bundle
    rc, md, err = run(capsys, "report", str(bundle))
    assert rc == 0, err
    cmds = _commands(md)
    assert any(c.startswith(f"# {MODULE} cannot be imported here: add --path DIR") for c in cmds)
    eager = next(c for c in cmds if "--mode eager" in c)
    assert f"--allow-target {TARGET}" in eager and "--path" not in eager

    rc, md, err = run(capsys, "report", str(bundle), "--path", str(src))
    assert rc == 0, err
    cmds = _commands(md)
    assert not any(c.startswith("#") for c in cmds)
    eager = next(c for c in cmds if "--mode eager" in c)
    assert eager.endswith(f"--allow-target {TARGET} --path {src}")
    rc, out, err = _run_printed(capsys, eager)
    assert rc == 0, out + err  # the printed command replays clean
    rc, _, err = _run_printed(capsys, next(c for c in cmds if c.startswith("kdump info")))
    assert rc == 0, err


def test_report_replay_uses_path(
    capsys: pytest.CaptureFixture[str], user_bundle: tuple[Path, Path]
) -> None:
    bundle, src = user_bundle
    argv = ["report", str(bundle), "--replay", "--allow-target", TARGET, "--device", "cpu"]
    rc, md, err = run(capsys, *argv, "--path", str(src))
    assert rc == 0, err
    verdicts = md.split("## Replay verdicts", 1)[1]
    assert "| eager | 0 | library | cpu | 0 | clean |" in verdicts


def test_slim_next_command_works_as_printed(
    capsys: pytest.CaptureFixture[str], user_bundle: tuple[Path, Path]
) -> None:
    from kdump.cli.slim import next_command

    bundle, src = user_bundle
    opts = ReplayOptions(mode="eager", backend="auto", device="cpu", paths=(str(src),))
    line = next_command(SimpleNamespace(output=bundle), opts)
    assert line == (
        f"kdump replay {bundle} --mode eager --device cpu --allow-target {TARGET} --path {src}"
    )
    rc, out, err = _run_printed(capsys, line)
    assert rc == 0, out + err


def test_slim_quiet_and_size_wording(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "slim", "--help")
    assert rc == 0 and "-q, --quiet" in out
    assert size_change(1000, 1200) == "grew by 200 bytes, 20.0%"
    assert size_change(1000, 1000) == "the same size as the original"
    assert size_change(1000, 990) == "1.0% smaller"  # never "1.0x smaller"
    assert size_change(10_000, 1000) == "10.0x smaller"


# --- doctor -------------------------------------------------------------------------------------


def test_doctor_lines_are_closed_and_fixes_are_actions() -> None:
    cut = {
        "name": "backend deep_gemm",
        "ok": False,
        "detail": "DeepGEMM is not importable here (deep_gemm: No module named 'deep_gemm'",
        "fix": "pip install the DeepGEMM build the bundle was recorded with",
    }
    assert tidy(cut)["detail"].endswith("'deep_gemm')")
    repeat = {
        "name": "backend packaged",
        "ok": False,
        "detail": "no CUDA device is visible to torch",
        "fix": "no CUDA device is visible to torch",
    }
    fixed = tidy(repeat)["fix"]
    assert fixed != repeat["detail"] and "CUDA build of torch" in fixed
    needs = {
        "name": "backend deep_gemm",
        "ok": False,
        "detail": "DeepGEMM 2.1",
        "fix": "needs a CUDA GPU",
    }
    assert tidy(needs)["fix"].startswith("run on a machine with an NVIDIA GPU")
    assert tidy({**repeat, "ok": True})["fix"] == ""
    for line in diagnose()["checks"]:
        assert line["detail"].count("(") <= line["detail"].count(")"), line
        if not line["ok"] and line["fix"]:
            assert line["fix"].lower() != line["detail"].lower(), line
            assert not line["fix"].lower().startswith("needs "), line


# --- report: redaction, multi-line meta, group ids -------------------------------------------


def _flight_bundle(tmp_path: Path) -> Path:
    meta = {
        "process": {"pid": 4242, "host": "gpu-node-17.cluster.example"},
        "crash": {
            "exit_code": 1,
            "stderr_tail": 'Traceback (most recent call last):\n  File "/home/alice/serve.py", '
            "line 3, in <module>\nRuntimeError: boom \x1b[31m ```` | x\n",
        },
        "journal": {"slot": 3, "seq": 9},
    }
    rec = capture_call("deep_gemm:m_grouped", [torch.ones(3)], {}, names=["a"], meta=meta)
    return save_calls(tmp_path / "flight.kdump", [rec], env={"python": "3.11"})


def test_redact_hides_flight_recorder_hosts_and_users(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = _flight_bundle(tmp_path)
    rc, plain, _ = run(capsys, "report", str(path))
    assert rc == 0 and "gpu-node-17" in plain and "alice" in plain  # the test can fail
    rc, md, _ = run(capsys, "report", str(path), "--redact")
    assert rc == 0
    assert "gpu-node-17" not in md and "alice" not in md and "cluster.example" not in md
    assert "| process.host | &lt;host&gt; |" in md


def test_multi_line_meta_is_a_code_block(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, md, _ = run(capsys, "report", str(_flight_bundle(tmp_path)))
    assert rc == 0
    assert "\\x0a" not in md  # not one table cell of escaped newlines
    assert "| crash.stderr\\_tail | (below) |" in md
    m = re.search(r"crash\.stderr\\_tail:\n\n(`{5,})\n(.*?)\n\1\n", md, re.S)
    assert m, md
    body = m.group(2).splitlines()
    assert body[0] == "Traceback (most recent call last):"
    assert body[-1] == "RuntimeError: boom \\x1b[31m ```` | x"  # ESC escaped, fence longer
    assert "\x1b" not in md


def test_group_ids_read_as_ids(capsys: pytest.CaptureFixture[str]) -> None:
    a, b = CAPTURES / "contiguous_ue8m0.kdump", CAPTURES / "contiguous_ue8m0_b.kdump"
    rc, out, _ = run(capsys, "diff", str(a), str(b))
    assert rc == 0
    assert "    empty in A: group 2\n" in out and "    empty in B: group 0\n" in out
    assert "changed:    groups 0, 1, 2, 3, 4, 5" in out and "empty groups A:" not in out


# --- the pytest plugin --------------------------------------------------------------------------


def test_plugin_refusals_name_the_plugin_options(user_bundle: tuple[Path, Path]) -> None:
    bundle, src = user_bundle
    why = refusal(bundle, (), ())
    assert why is not None and f"--kdump-allow-target '{TARGET}'" in why
    assert "kdump_allow_targets" in why and " --allow-target" not in why
    why = refusal(bundle, (f"{MODULE}:*",), ())
    assert why is not None and "--kdump-path DIR" in why and "kdump_path" in why
    assert refusal(bundle, (TARGET,), (str(src),)) is None


def _verdict(target: str, message: str) -> Verdict:
    v = Verdict("b.kdump", 0, target, "eager")
    v.findings = [Finding("cannot_run", "eager/setup", message)]
    return v


def test_unimportable_own_target_fails_but_missing_library_skips() -> None:
    own = _verdict(TARGET, f"cannot import {MODULE} to replay {TARGET}: No module named x")
    result, why = outcome([own])
    assert result == "failed" and "--kdump-path DIR" in why
    lib = _verdict(
        "deep_gemm:m_grouped_fp8_gemm_nt_contiguous", "cannot import deep_gemm: No module"
    )
    assert outcome([lib])[0] == "skipped"
    gpu = _verdict(TARGET, "needs a CUDA GPU")
    assert outcome([gpu])[0] == "skipped"


def _installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == "kdump.pytest_plugin" for ep in entry_points(group="pytest11"))


def test_plugin_kdump_path_end_to_end(user_bundle: tuple[Path, Path], tmp_path: Path) -> None:
    bundle, _ = user_bundle
    (tmp_path / "bundles").mkdir()
    bundle.rename(tmp_path / "bundles" / bundle.name)
    base = [*([] if _installed() else ["-p", "kdump.pytest_plugin"]), "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    ini = "[pytest]\nkdump_device = cpu\nkdump_allow_targets = {}\n".format(f"{MODULE}:*")

    def pytest_run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", *base, "-q", "--kdump", "bundles", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    (tmp_path / "pytest.ini").write_text(ini)
    res = pytest_run()
    assert res.returncode == 1 and "1 failed" in res.stdout, res.stdout + res.stderr
    assert "--kdump-path DIR" in res.stdout
    res = pytest_run("--kdump-path", "src")
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout + res.stderr
    (tmp_path / "pytest.ini").write_text(ini + "kdump_path = src\n")
    res = pytest_run()
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout + res.stderr


def test_plugin_docstring_names_its_options() -> None:
    import kdump.pytest_plugin as plugin

    doc = textwrap.dedent(plugin.__doc__ or "")
    assert "--kdump-path" in doc and "kdump_path" in doc
