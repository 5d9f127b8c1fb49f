"""Typed replay options: the round trip to a child process, rejection of unknown keys, and the
exit-code table that verdicts, the CLI, `--help` and the README share."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kdump.errors import (
    BundleError,
    CannotRunError,
    ContractViolation,
    ExitCode,
    FindingKind,
    KdumpError,
    UsageError,
    exit_codes_help,
    exit_codes_markdown,
    kind_exit_code,
)
from kdump.kernels.registry import backend_names
from kdump.replay.options import (
    MODES,
    TOOLS,
    GraphOptions,
    ReplayOptions,
    SanitizerOptions,
    from_keywords,
)
from kdump.replay.session import Request
from kdump.replay.verdict import Finding, Verdict

ROOT = Path(__file__).parent.parent

options = st.builds(
    ReplayOptions,
    mode=st.sampled_from(MODES),
    backend=st.sampled_from(backend_names()),
    device=st.sampled_from(["auto", "cpu", "cuda:1"]),
    repeat=st.integers(1, 1000),
    force=st.booleans(),
    timeout=st.one_of(st.none(), st.floats(0.5, 1e4)),
    halo=st.integers(0, 1 << 20),
    then=st.lists(st.text("ab.:0123", min_size=1), max_size=3).map(tuple),
    save_failing=st.one_of(st.none(), st.just("repro")),
    graph=st.builds(
        GraphOptions,
        mutations=st.integers(0, 100),
        seed=st.integers(0, 2**31),
        skip_steps=st.lists(st.text(min_size=1), max_size=3).map(tuple),
    ),
    sanitizer=st.builds(
        SanitizerOptions,
        tools=st.lists(st.sampled_from(TOOLS), min_size=1, max_size=4, unique=True).map(tuple),
        graph=st.booleans(),
        kernel_filter=st.one_of(st.none(), st.just("kd_gemm")),
    ),
)


@given(options)
def test_options_round_trip_through_json(opts: ReplayOptions) -> None:
    req = Request("a.kdump", 3, opts)
    back = Request.from_dict(json.loads(json.dumps(req.to_dict())))
    assert back == req
    assert back.options.sanitizer.tools == opts.sanitizer.tools


def test_unknown_option_keys_are_usage_errors() -> None:
    d = ReplayOptions().to_dict()
    with pytest.raises(UsageError, match=r"unknown replay option.*colour"):
        ReplayOptions.from_dict({**d, "colour": "red"})
    with pytest.raises(UsageError, match=r"sanitizer\.binray"):
        ReplayOptions.from_dict({**d, "sanitizer": {**d["sanitizer"], "binray": "/x"}})
    with pytest.raises(UsageError, match="unknown replay request key"):
        Request.from_dict({**Request("a", 0).to_dict(), "extra": 1})
    with pytest.raises(UsageError, match="unknown replay option 'mutatoins'"):
        from_keywords(mutatoins=3)


def test_invalid_choices_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="unknown mode 'fast'"):
        ReplayOptions(mode="fast")
    with pytest.raises(UsageError, match="unknown backend"):
        ReplayOptions(backend="cublas")
    with pytest.raises(UsageError, match="unknown sanitizer tool"):
        ReplayOptions(sanitizer=SanitizerOptions(tools=("leakcheck",)))
    with pytest.raises(UsageError, match="no sanitizer tool"):
        ReplayOptions(sanitizer=SanitizerOptions(tools=()))


def test_legacy_keywords_map_to_typed_fields() -> None:
    opts = from_keywords(
        mode="graph", mutations=2, seed=9, sanitizer="/opt/cs", sanitizer_log_dir="logs", then=["b"]
    )
    assert opts.mode == "graph" and opts.then == ("b",)
    assert opts.graph == GraphOptions(mutations=2, seed=9)
    assert (opts.sanitizer.binary, opts.sanitizer.log_dir) == ("/opt/cs", "logs")
    child = opts.for_sanitizer("eager")
    assert (child.mode, child.placement, child.halo, child.reference, child.repeat) == (
        "eager",
        "flush_end",
        0,
        False,
        1,
    )
    with pytest.raises(UsageError):
        opts.for_child("sanitizer")  # one child runs eager or graph


def test_cli_choices_are_the_options_choices() -> None:
    from kdump.cli.replay import command

    choices = {p.name: tuple(p.type.choices) for p in command.params if hasattr(p.type, "choices")}
    assert choices["mode"] == MODES
    assert choices["backend"] == backend_names()
    assert choices["tools"] == (*TOOLS, "all")


def test_readme_exit_code_table_is_generated_from_errors() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Exit codes\n", 1)[1].split("\n## ", 1)[0].strip()
    assert section == exit_codes_markdown()


def test_help_texts_carry_the_generated_exit_codes() -> None:
    from click.testing import CliRunner

    from kdump.cli import cli

    expected = " ".join(exit_codes_help().replace("\b", "").split())
    for argv in (["--help"], ["replay", "--help"]):
        out = CliRunner().invoke(cli, argv).output
        assert expected in " ".join(out.split()), argv
    assert "125 cannot run here" in expected and "order 2, 125, 70, 5, 3, 4, 1" in expected


def test_every_kind_has_one_code_and_errors_follow_the_table() -> None:
    assert kind_exit_code("hang") == ExitCode.KERNEL_ERROR
    assert kind_exit_code("nondeterminism") == ExitCode.MISMATCH
    assert kind_exit_code("no such kind") == ExitCode.INTERNAL
    for cls, kind in [
        (UsageError, FindingKind.USAGE),
        (BundleError, FindingKind.BUNDLE),
        (CannotRunError, FindingKind.CANNOT_RUN),
        (ContractViolation, FindingKind.CONTRACT),
        (KdumpError, FindingKind.INTERNAL),
    ]:
        assert cls.finding_kind is kind and cls.exit_code == kind.code
    v = Verdict("b", 0, "t", "eager")
    v.findings += [Finding("memory", "s", "m"), Finding("hang", "s", "h")]
    assert v.exit_code == 3
    # The code follows the kind: an error class cannot name a code of its own.
    with pytest.raises(TypeError, match="sets exit_code"):
        type("Odd", (KdumpError,), {"exit_code": ExitCode.USAGE})
    assert type("Fine", (CannotRunError,), {}).exit_code == ExitCode.CANNOT_RUN


def test_finding_kinds_used_by_replay_are_in_the_table() -> None:
    """Every literal kind passed to Finding(...) or finding(...) in kdump/replay is a known one."""
    pattern = re.compile(r"(?:Finding|finding)\(\s*\"(\w+)\"")
    used = set()
    for path in (ROOT / "kdump" / "replay").glob("*.py"):
        used |= set(pattern.findall(path.read_text()))
    assert {"mismatch", "memory", "contract", "kernel_error"} <= used
    assert used <= {k.value for k in FindingKind}


def test_replace_keeps_validation() -> None:
    with pytest.raises(UsageError):
        replace(ReplayOptions(), repeat=0)
