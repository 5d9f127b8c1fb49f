"""The report's routing plot: the PNG beside `-o`, its size as stated, the data table behind it,
and the report without matplotlib."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdump.bundle import capture_call, load_bundle, save_calls
from kdump.cli import main
from kdump.report.plot import INSTALL_HINT, call_role, plot_path

CAPTURES = Path(__file__).resolve().parent.parent / "captures"
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def tables(md: str) -> list[list[list[str]]]:
    found: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*md.splitlines(), ""]:
        if line.startswith("|"):
            current.append([c.strip() for c in _CELL_SPLIT.split(line)[1:-1]])
        elif current:
            found.append(current)
            current = []
    return found


def check_tables_render(md: str) -> None:
    """Every table has one column count; with a Markdown parser installed, each renders as a
    table with as many rows (a malformed one renders as a paragraph)."""
    found = tables(md)
    for t in found:
        assert {len(r) for r in t} == {len(t[0])} and set(t[1]) == {"---"}, t
    try:
        from markdown_it import MarkdownIt
    except ImportError:
        return
    tokens = MarkdownIt("commonmark").enable("table").parse(md)
    rendered = [t for t in tokens if t.type == "table_open"]
    assert len(rendered) == len(found)
    rows = sum(1 for t in tokens if t.type == "tr_open")
    assert rows == sum(len(t) - 1 for t in found)


def two_call_bundle(tmp_path: Path) -> Path:
    """The same layer's capture call and a later call (as a salvaged graph replay says)."""
    recs = []
    for name in ("contiguous_ue8m0.kdump", "contiguous_ue8m0_b.kdump"):
        c = load_bundle(CAPTURES / name).calls[0]
        recs.append(capture_call(c.target, c.args, c.kwargs, names=c.names))
    info = {"graph_replay": {"capture_call": 0, "replay_call": 1}}
    return save_calls(tmp_path / "two.kdump", recs, info=info)


def _counts(name: str) -> list[int]:
    call = load_bundle(CAPTURES / name).calls[0]
    labels, groups = call.args[3], call.args[1][0].shape[0]
    return torch.bincount(labels[labels >= 0].long(), minlength=groups).tolist()


def test_plot_beside_the_report_with_its_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    bundle = two_call_bundle(tmp_path)
    report = tmp_path / "out" / "report.md"
    report.parent.mkdir()
    code, out, _ = run(capsys, "report", str(bundle), "-o", str(report))
    assert code == 0 and out == ""
    md = report.read_text()
    png = plot_path(report)
    assert png == tmp_path / "out" / "report-routing.png" and png.is_file()
    m = re.search(
        r"!\[[^\]]*\]\(report-routing\.png\)\n\nPlot: report-routing\.png \((\d+)×(\d+)", md
    )
    assert m, md
    with Image.open(png) as img:
        img.load()
        assert img.format == "PNG" and img.size == (int(m.group(1)), int(m.group(2)))
        assert img.size == (960, 320)  # two panels side by side
    check_tables_render(md)
    [routing] = [t for t in tables(md) if t[0][0] == "group"]
    assert routing[0] == ["group", "call 0", "call 1"]
    a, b = _counts("contiguous_ue8m0.kdump"), _counts("contiguous_ue8m0_b.kdump")
    assert routing[2:8] == [[str(g), str(a[g]), str(b[g])] for g in range(6)]
    assert ["empty groups", "group 2", "group 0"] in routing  # one empty group each, both visible


def test_call_roles_of_a_graph_replay_bundle(tmp_path: Path) -> None:
    bundle = load_bundle(two_call_bundle(tmp_path))
    assert [call_role(bundle, c) for c in bundle.calls] == ["capture", "replay"]
    single = load_bundle(CAPTURES / "masked_ue8m0.kdump")
    assert call_role(single, single.calls[0]) == ""


def test_no_plot_flag_and_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "r.md"
    code, _, _ = run(
        capsys, "report", str(CAPTURES / "masked_ue8m0.kdump"), "-o", str(report), "--no-plot"
    )
    assert code == 0 and not plot_path(report).exists()
    assert "report-routing.png" not in report.read_text()
    code, out, _ = run(capsys, "report", str(CAPTURES / "masked_ue8m0.kdump"))
    assert code == 0 and ".png" not in out and "## Routing metadata" in out


def test_no_routing_no_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_calls(tmp_path / "g.kdump", [capture_call("m:f", [torch.ones(3)], {})])
    report = tmp_path / "g.md"
    assert run(capsys, "report", str(path), "-o", str(report))[0] == 0
    assert not plot_path(report).exists() and "Routing" not in report.read_text()


def test_without_matplotlib_the_report_says_how_and_keeps_its_tables(tmp_path: Path) -> None:
    """In a process where matplotlib cannot be imported: no PNG, the install hint, all tables."""
    report = tmp_path / "r.md"
    code = (
        "import sys, importlib.util\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n.split('.')[0] == 'matplotlib' "
        "else real(n, *a)\n"
        "sys.modules['matplotlib'] = None\n"
        "from kdump.cli import main\n"
        f"main(['report', {str(two_call_bundle(tmp_path))!r}, '-o', {str(report)!r}])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    md = report.read_text()
    assert not plot_path(report).exists()
    assert INSTALL_HINT in md and "pip install -e '.[report]'" in INSTALL_HINT
    check_tables_render(md)
    assert [t for t in tables(md) if t[0][0] == "group"]
