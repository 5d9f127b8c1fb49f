"""Untrusted bundles: replay runs only chosen code, a bundle informs and the user decides, and
everything shown from a bundle is escaped."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kdump.bundle import attach_outputs, capture_call, input_tensors, save_calls
from kdump.cli import main
from kdump.errors import ExitCode, UntrustedTargetError
from kdump.kernels import registry
from kdump.kernels.deepgemm.plugin import PLUGIN as DEEPGEMM
from kdump.replay.child import confine_imports, run_in_child, run_in_process
from kdump.replay.options import ReplayOptions
from kdump.replay.session import Request
from kdump.text import visible

MARKER = "MARKER"
CWD_MODULE = "kdump_trust_probe"  # written into the (temporary) current folder
# A module that leaves the marker when it is imported, and again when its function runs.
CWD_SOURCE = "open('MARKER', 'w').close()\n\n\ndef run(path):\n    open(path, 'w').close()\n"
HOSTILE = {
    "os:system": (["touch MARKER"], {}),
    "builtins:exec": (["open('MARKER', 'w').close()"], {}),
    "subprocess:run": ([["touch", "MARKER"]], {}),
    f"{CWD_MODULE}:run": (["MARKER"], {}),
}
# An OSC 52 clipboard write, a screen clear, rich markup and a lone surrogate.
EVIL = "\x1b]52;c;ZXZpbA==\x07\x1b[2J[/][/blue]\udcff"


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh current folder holding a module that leaves the marker when imported, and a
    user config that allows nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{CWD_MODULE}.py").write_text(CWD_SOURCE)
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "no-config.toml"))
    sys.modules.pop(CWD_MODULE, None)
    return tmp_path


def _bundle(path: Path, target: str, args: list, kwargs: dict, **save: object) -> Path:
    call = capture_call(target, args, kwargs, names=["arg"])
    return save_calls(path, [call], **save)  # type: ignore[arg-type]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


REPLAY = ("--device", "cpu", "--backend", "library", "--repeat", "1")


@pytest.mark.parametrize("target", sorted(HOSTILE))
def test_hostile_target_never_runs(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    args, kwargs = HOSTILE[target]
    bundle = _bundle(in_tmp / "hostile.kdump", target, args, kwargs)
    code, _, err = _cli(capsys, "replay", str(bundle), *REPLAY)
    assert code == ExitCode.USAGE
    assert f"--allow-target '{target}'" in err and "allow-targets" in err
    assert len(err.strip().splitlines()) == 1
    assert not (in_tmp / MARKER).exists()
    assert CWD_MODULE not in sys.modules


@pytest.mark.parametrize("target", sorted(HOSTILE))
def test_child_refuses_a_target_the_parent_did_not_check(in_tmp: Path, target: str) -> None:
    args, kwargs = HOSTILE[target]
    bundle = _bundle(in_tmp / "hostile.kdump", target, args, kwargs)
    req = Request(str(bundle), 0, ReplayOptions(device="cpu", backend="library", repeat=1))
    for verdict in (run_in_child(req, 120), run_in_process(req)):
        assert verdict.exit_code == ExitCode.USAGE
        assert "--allow-target" in verdict.findings[0].message
    assert not (in_tmp / MARKER).exists()


def test_allowed_target_runs(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _bundle(in_tmp / "sys.kdump", "os:system", *HOSTILE["os:system"])
    code, out, err = _cli(capsys, "replay", str(bundle), *REPLAY, "--allow-target", "os:system")
    assert code == 0, out + err
    assert (in_tmp / MARKER).exists()


def test_glob_and_config_file_allow(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = _bundle(in_tmp / "run.kdump", "subprocess:run", *HOSTILE["subprocess:run"])
    code, _, err = _cli(capsys, "replay", str(bundle), *REPLAY, "--allow-target", "subprocess:*")
    assert code == 0, err
    assert (in_tmp / MARKER).exists()
    (in_tmp / MARKER).unlink()
    config = in_tmp / "config.toml"
    config.write_text('allow-targets = ["builtins:ex*"]\n')
    monkeypatch.setenv("KDUMP_CONFIG", str(config))
    bundle = _bundle(in_tmp / "exec.kdump", "builtins:exec", *HOSTILE["builtins:exec"])
    code, _, err = _cli(capsys, "replay", str(bundle), *REPLAY)
    assert code == 0, err
    assert (in_tmp / MARKER).exists()
    config.write_text("allow-targets = [oops\n")
    code, _, err = _cli(capsys, "replay", str(bundle), *REPLAY)
    assert code == ExitCode.USAGE and "not valid TOML" in err


def test_current_folder_module_imports_only_from_an_explicit_path(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"{CWD_MODULE}:run"
    bundle = _bundle(in_tmp / "cwd.kdump", target, *HOSTILE[target])
    code, _, err = _cli(capsys, "replay", str(bundle), *REPLAY, "--allow-target", target)
    assert code == ExitCode.CANNOT_RUN, err
    assert not (in_tmp / MARKER).exists()
    code, out, err = _cli(
        capsys, "replay", str(bundle), *REPLAY, "--allow-target", target, "--path", str(in_tmp)
    )
    assert code == 0, out + err
    assert (in_tmp / MARKER).exists()


def test_plugin_names_alone_do_not_make_a_target_trusted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KDUMP_CONFIG", str(tmp_path / "none.toml"))
    known = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
    assert registry.target_allowed(known)
    for target in ("deep_gemm:os.system", "deep_gemm:system", "os:system", "kdump:replay"):
        assert not registry.target_allowed(target)
        with pytest.raises(UntrustedTargetError):
            registry.check_target(target)
    assert registry.target_allowed("os:system", ("os:*",))
    assert not registry.target_allowed("os:system", ("subprocess:*",))


def test_confine_imports_drops_the_current_folder_keeps_pythonpath(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keep, extra = tmp_path / "keep", tmp_path / "extra"
    keep.mkdir()
    extra.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(keep))
    monkeypatch.setattr(sys, "path", ["", str(tmp_path), ".", str(keep), "/usr/lib/python3"])
    confine_imports([str(extra)])
    assert sys.path == [str(extra), str(keep), "/usr/lib/python3"]
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the checkout kdump runs from stays
    monkeypatch.setattr(sys, "path", ["", str(tmp_path)])
    confine_imports([])
    assert sys.path == [str(tmp_path)]


def test_reading_commands_never_import_the_target(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(in_tmp))  # importable here: only an import would run it
    target = f"{CWD_MODULE}:run"
    bundle = _bundle(in_tmp / "probe.kdump", target, *HOSTILE[target])
    for argv in (
        ("info", str(bundle)),
        ("info", "--verify", "--json", str(bundle)),
        ("diff", str(bundle), str(bundle)),
        ("report", str(bundle)),
        ("pack", str(bundle), "-o", str(in_tmp / "packed.kdump")),
    ):
        code, _, err = _cli(capsys, *argv)
        assert code == 0, (argv, err)
    assert (in_tmp / "packed.kdump").stat().st_size > 0
    assert CWD_MODULE not in sys.modules
    assert not (in_tmp / MARKER).exists()


def _evil_bundle(path: Path) -> Path:
    x = torch.randn(8, 4)
    out = torch.empty(8, 4)
    target = f"mod{EVIL}:fn{EVIL}"
    call = capture_call(target, [x, out], {}, names=[f"x{EVIL}", "out"], meta={"exception": EVIL})
    live = input_tensors(call, [x, out], {})
    out.copy_(x * 2)
    attach_outputs(call, live, [1])
    env = {
        "hostname": EVIL,
        "env_vars": {f"DG_{EVIL}": EVIL, "DG_JIT_CACHE_DIR": f"/tmp/{EVIL}"},
        "libraries": {"deep_gemm": {"version": EVIL, "setters": {EVIL: [EVIL]}}},
    }
    return save_calls(path, [call], env=env)


def _assert_safe(code: int, out: str, err: str, codes: tuple[int, ...]) -> None:
    assert code in codes, out + err
    for stream in (out, err):
        assert "\x1b" not in stream and "\x07" not in stream
        assert "Traceback" not in stream and "internal error" not in stream
        stream.encode("utf-8")  # no lone surrogate


def test_bundle_strings_are_escaped_everywhere(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = _evil_bundle(in_tmp / "evil.kdump")
    code, out, err = _cli(capsys, "info", str(bundle))
    _assert_safe(code, out, err, (0,))
    assert "\\x1b]52" in out and "[/]" in out and "DG_JIT_CACHE_DIR" in out
    code, out, err = _cli(capsys, "info", "--json", str(bundle))
    _assert_safe(code, out, err, (0,))
    # JSON shows bundle strings the way the table does: escapes visible, nothing raw
    [rep] = json.loads(out)
    assert rep["env"]["hostname"] == visible(EVIL)
    code, out, err = _cli(capsys, "replay", str(bundle), *REPLAY)
    _assert_safe(code, out, err, (ExitCode.USAGE,))
    assert "\\x1b]52" in err
    code, out, err = _cli(capsys, "replay", str(bundle), *REPLAY, "--allow-target", "*")
    _assert_safe(code, out, err, (ExitCode.CANNOT_RUN,))
    assert "\\x1b" in out
    code, out, err = _cli(capsys, "report", str(bundle))
    _assert_safe(code, out, err, (0,))
    code, out, err = _cli(capsys, "diff", str(bundle), str(bundle))
    _assert_safe(code, out, err, (0,))


def test_exception_text_from_the_target_is_escaped(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = f"raise RuntimeError({EVIL!r})"
    bundle = _bundle(in_tmp / "raise.kdump", "builtins:exec", [source], {})
    allow = ("--allow-target", "builtins:exec")
    code, out, err = _cli(capsys, "replay", str(bundle), *REPLAY, *allow)
    _assert_safe(code, out, err, (ExitCode.KERNEL_ERROR, ExitCode.INTERNAL))
    assert "RuntimeError" in out and "\\x1b]52" in out
    code, out, err = _cli(capsys, "replay", str(bundle), *REPLAY, *allow, "--json")
    _assert_safe(code, out, err, (ExitCode.KERNEL_ERROR, ExitCode.INTERNAL))
    assert EVIL in json.loads(out)["verdicts"][0]["headline"]


def test_recorded_dg_variables_apply_only_when_asked(
    in_tmp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DG_JIT_CACHE_DIR", raising=False)
    monkeypatch.delenv("DG_KDUMP_PROBE", raising=False)
    # The recorded value is a folder the replayed target writes into when it sees it.
    cache = in_tmp / "cache"
    cache.mkdir()
    source = "import os\nd = os.environ.get('DG_JIT_CACHE_DIR')\nif d: open(d + '/seen', 'w')"
    env = {"env_vars": {"DG_JIT_CACHE_DIR": str(cache), "DG_KDUMP_PROBE": str(cache)}}
    bundle = _bundle(in_tmp / "env.kdump", "builtins:exec", [source], {}, env=env)
    allow = ("--allow-target", "builtins:exec")
    code, out, err = _cli(capsys, "replay", str(bundle), *REPLAY, *allow)
    assert code == 0, out + err
    assert not (cache / "seen").exists()
    code, out, err = _cli(
        capsys, "replay", str(bundle), *REPLAY, *allow, "--apply-env", "DG_JIT_CACHE_DIR"
    )
    assert code == 0, out + err
    assert (cache / "seen").exists()
    assert "DG_KDUMP_PROBE" not in os.environ


def test_unknown_deepgemm_setting_is_shown_never_called(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, tuple]] = []

    def recorder(name: str):
        return lambda *a, **k: calls.append((name, a))

    fake = SimpleNamespace(
        __name__="deep_gemm",
        __version__="2.1",
        system=recorder("system"),
        set_evil=recorder("set_evil"),
        set_num_sms=recorder("set_num_sms"),
        set_tc_util=recorder("set_tc_util"),
    )
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    recorded = {
        "version": "2.1",
        "num_sms": 24,
        "system": "touch MARKER",
        "setters": {"set_evil": {"args": ["x"], "kwargs": {}}, "set_tc_util": 70},
    }
    notes = DEEPGEMM.apply_state(recorded, torch.device("cpu"))
    assert ("set_num_sms", (24,)) in calls and ("set_tc_util", (70,)) in calls
    assert not [c for c in calls if c[0] in ("system", "set_evil")]
    unknown = next(n for n in notes if "unknown to kdump" in n)
    assert "system" in unknown and "set_evil" in unknown
    assert "system" not in DEEPGEMM.known_settings()
    assert DEEPGEMM.known_settings() >= {"num_sms", "tc_util", "mk_alignment"}
    assert DEEPGEMM.apply_state(["not", "a", "mapping"], torch.device("cpu")) == []
