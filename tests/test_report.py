"""Routing summaries and `kdump report` (Markdown): counts, table shape, escaping, redaction."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest
import torch

from kdump.bundle import capture_call, load_bundle, save_calls
from kdump.cli import main
from kdump.kernels.plugin import summarize_histogram
from kdump.report.markdown import ReportOptions, render_report
from kdump.report.routing import routing_summaries

CAPTURES = Path(__file__).resolve().parent.parent / "captures"
HOSTILE = "evil\x1b[31m|`tick`|[bold]red[/]<script>x</script>\n# heading"
GEN = torch.Generator().manual_seed(5)
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def tables(md: str) -> list[list[list[str]]]:
    """Every Markdown table as rows of cells (split on unescaped pipes)."""
    found: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*md.splitlines(), ""]:
        if line.startswith("|"):
            current.append([c.strip() for c in _CELL_SPLIT.split(line)[1:-1]])
        elif current:
            found.append(current)
            current = []
    return found


def assert_well_formed(md: str) -> list[list[list[str]]]:
    found = tables(md)
    assert found
    for t in found:
        assert len(t) >= 3, t
        assert {len(r) for r in t} == {len(t[0])}, t
        assert set(t[1]) == {"---"}
    return found


def _routing_values(name: str) -> tuple[torch.Tensor, int, int]:
    call = load_bundle(CAPTURES / name).calls[0]
    return call.args[3], call.args[1][0].shape[0], call.args[0][0].shape[-2]


def test_labels_summary_matches_bincount() -> None:
    for name in ("contiguous_ue8m0.kdump", "contiguous_ue8m0_b.kdump", "contiguous_fp32.kdump"):
        labels, groups, _ = _routing_values(name)
        bundle = load_bundle(CAPTURES / name)
        [s] = routing_summaries(bundle, bundle.calls[0])
        want = torch.bincount(labels[labels >= 0].long(), minlength=groups).tolist()
        assert s.layout == "labels" and list(s.counts) == want
        assert s.padding == int((labels == -1).sum())
        assert s.empty_groups == tuple(g for g, c in enumerate(want) if c == 0)


def test_psum_summary_matches_aligned_starts() -> None:
    ends, _, _ = _routing_values("contiguous_psum_fp32.kdump")
    ends = ends.tolist()
    starts = [0] + [-(-e // 128) * 128 for e in ends[:-1]]
    bundle = load_bundle(CAPTURES / "contiguous_psum_fp32.kdump")
    [s] = routing_summaries(bundle, bundle.calls[0])
    assert s.layout == "psum"
    assert list(s.counts) == [e - st for e, st in zip(ends, starts)]
    assert s.padding == sum(st - e for st, e in zip(starts[1:], ends[:-1]))


def test_masked_summary_is_masked_m() -> None:
    masked_m, _, max_m = _routing_values("masked_ue8m0.kdump")
    bundle = load_bundle(CAPTURES / "masked_ue8m0.kdump")
    [s] = routing_summaries(bundle, bundle.calls[0])
    assert s.layout == "masked" and list(s.counts) == masked_m.tolist()
    assert s.padding == max_m * len(masked_m) - int(masked_m.sum())


def test_histogram_of_generic_values() -> None:
    values = torch.randint(0, 5, (200,), generator=GEN).tolist()
    s = summarize_histogram("ids", values)
    assert dict(zip(s.groups, s.counts)) == {v: values.count(v) for v in set(values)}


def test_report_tables_are_well_formed_and_hold_counts() -> None:
    path = CAPTURES / "contiguous_ue8m0.kdump"
    bundle = load_bundle(path)
    md = render_report(bundle, str(path))
    found = assert_well_formed(md)
    labels, groups, _ = _routing_values("contiguous_ue8m0.kdump")
    counts = torch.bincount(labels[labels >= 0].long(), minlength=groups).tolist()
    [routing] = [t for t in found if t[0][0] == "group"]
    assert [r[1] for r in routing[2 : 2 + groups]] == [str(c) for c in counts]
    assert ["padding rows", str(int((labels == -1).sum()))] in routing
    assert hashlib.sha256(path.read_bytes()).hexdigest() in md
    assert f"| size | {path.stat().st_size} bytes |" in md
    assert f"kdump replay {path} --mode graph" in md
    assert "Privacy" in md
    [args] = [t for t in found if t[0][0] == "argument" and "dtype" in t[0]]
    assert [r[0] for r in args[2:]] == [
        "a\\[0\\]", "a\\[1\\]", "b\\[0\\]", "b\\[1\\]", "d", "grouped\\_layout"
    ]  # fmt: skip


def test_report_puts_calls_of_one_target_side_by_side(tmp_path: Path) -> None:
    recs = []
    for name in ("contiguous_ue8m0.kdump", "contiguous_ue8m0_b.kdump"):
        c = load_bundle(CAPTURES / name).calls[0]
        recs.append(capture_call(c.target, c.args, c.kwargs, names=c.names))
    two = save_calls(tmp_path / "two.kdump", recs)
    md = render_report(load_bundle(two))
    [routing] = [t for t in assert_well_formed(md) if t[0][0] == "group"]
    assert routing[0] == ["group", "call 0", "call 1"]
    labels_a = _routing_values("contiguous_ue8m0.kdump")[0]
    labels_b = _routing_values("contiguous_ue8m0_b.kdump")[0]
    ca = torch.bincount(labels_a[labels_a >= 0].long(), minlength=6).tolist()
    cb = torch.bincount(labels_b[labels_b >= 0].long(), minlength=6).tolist()
    assert routing[2:8] == [[str(g), str(ca[g]), str(cb[g])] for g in range(6)]
    assert f"kdump diff {two}#0 {two}#1" in md


def _hostile_bundle(path: Path) -> Path:
    x = torch.randn(4, 8, generator=GEN)
    rec = capture_call(
        "mod:" + HOSTILE, [x, HOSTILE], {"note": HOSTILE}, names=["x|`y`", "s"], meta={"k": HOSTILE}
    )
    env = {
        "hostname": "build-host-42",
        "argv": ["/home/alice/serve.py", HOSTILE],
        "env_vars": {"HF_TOKEN": "secret-value-123", "USER": "alice", "X": HOSTILE},
        "libraries": {"lib": {"setting": HOSTILE}},
    }
    return save_calls(path, [rec], env=env)


def test_hostile_strings_are_escaped_in_markdown(tmp_path: Path) -> None:
    md = render_report(load_bundle(_hostile_bundle(tmp_path / "h.kdump")))
    assert_well_formed(md)
    assert "\x1b" not in md and "<script>" not in md and "\n# heading" not in md
    assert "&lt;script&gt;" in md and "\\x1b\\[31m" in md
    for line in md.splitlines():
        if line.startswith("|"):  # every backtick inside a table is literal
            assert re.search(r"(?<!\\)`", line) is None, line


def test_redact_removes_hosts_users_paths_and_env_values(tmp_path: Path) -> None:
    bundle = load_bundle(_hostile_bundle(tmp_path / "h.kdump"))
    plain = render_report(bundle)
    for secret in ("build-host-42", "secret-value-123", "alice", str(tmp_path)):
        assert secret in plain
    red = render_report(bundle, options=ReportOptions(redact=True))
    assert_well_formed(red)
    for secret in ("build-host-42", "secret-value-123", "alice", str(tmp_path), "/home"):
        assert secret not in red, secret
    assert "&lt;redacted&gt;" in red and "h.kdump" in red


def test_cli_report_to_file_and_stdout_with_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(CAPTURES / "masked_ue8m0.kdump")
    out_file = tmp_path / "r.md"
    code, out, _ = run(capsys, "report", path, "-o", str(out_file))
    assert code == 0 and out == ""
    assert "| 2 | 64 |" in out_file.read_text()
    args = ["report", path, "--replay", "--backend", "reference", "--device", "cpu"]
    code, out, _ = run(capsys, *args)
    assert code == 0
    [verdicts] = [t for t in assert_well_formed(out) if t[0][0] == "mode"]
    assert verdicts[2] == ["eager", "0", "reference", "cpu", "0", "clean"]
    assert f"kdump replay {path} --mode eager --backend reference --device cpu" in out


def test_cli_report_bad_bundle_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.kdump"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxxx")
    code, _, err = run(capsys, "report", str(junk))
    assert code == 2 and err.startswith("kdump: error:")


def test_cli_report_with_script_lists_it_in_reproduce(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(CAPTURES / "contiguous_fp32.kdump")
    script = tmp_path / "repro.py"
    code, out, err = run(capsys, "report", path, "--script", str(script))
    assert code == 0 and script.is_file() and os.access(script, os.X_OK)
    assert f"python {script}  # standalone" in out
    assert err == f"wrote {script}; run it with: python {script}\n"
    compile(script.read_text(), str(script), "exec")
