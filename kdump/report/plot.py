"""The report's routing plot: tokens per group of each routing argument, one panel per call (a
capture call and a replay call side by side when the bundle holds both), as a PNG.

matplotlib is optional (`kdump-gpu[report]`), imported only here and only when a plot is drawn,
with the Agg backend (no display). The plot's data are the report's routing tables
(kdump.report.routing), so the Markdown holds every number the picture shows.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kdump.bundle import Bundle, Call
from kdump.kernels.plugin import RoutingSummary
from kdump.report.routing import routing_summaries
from kdump.text import visible

DPI = 100
PANEL_INCHES = (4.8, 3.2)  # width, height of one panel
MAX_PANELS = 4  # calls shown side by side per routing argument (the table has them all)
MAX_ROWS = 6  # routing arguments plotted (one row of panels each)
INSTALL_HINT = (
    "The routing plot needs matplotlib: `pip install 'kdump-gpu[report]'` "
    "(from a source checkout: `pip install -e '.[report]'`)."
)


@dataclass(frozen=True)
class Panel:
    title: str  # already made visible (escaped); matplotlib shows it without math parsing
    summary: RoutingSummary


@dataclass(frozen=True)
class PlotResult:
    """What the report says about the plot: where it is and its size, or why there is none."""

    path: Path | None = None
    size: tuple[int, int] | None = None  # pixels (width, height)
    note: str | None = None


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def call_role(bundle: Bundle, call: Call) -> str:
    """'capture' / 'replay' when the bundle says so (a salvaged graph replay's info, a graph
    failure saved as capture + replay call), else ''."""
    graph = bundle.info.get("graph_replay")
    if isinstance(graph, dict):
        if graph.get("capture_call") == call.index:
            return "capture"
        if graph.get("replay_call") == call.index:
            return "replay"
    role = call.meta.get("graph_role")
    if isinstance(role, str) and role.split(":")[0] in ("capture", "replay"):
        return role.split(":")[0]
    return "capture" if call.meta.get("capturing") else ""


def panels(bundle: Bundle) -> list[tuple[str, list[Panel]]]:
    """(row title, panels) per (target, routing argument), the calls in bundle order."""
    rows: dict[tuple[str, str], list[Panel]] = {}
    for call in bundle.calls:
        role = call_role(bundle, call)
        for s in routing_summaries(bundle, call):
            title = f"call {call.index}" + (f" ({role})" if role else "")
            rows.setdefault((call.target, s.argument), []).append(Panel(title, s))
    out = []
    for (target, argument), ps in list(rows.items())[:MAX_ROWS]:
        out.append((f"{visible(argument, 60)} of {visible(target, 80)}", ps[:MAX_PANELS]))
    return out


def figure_size(rows: Sequence[tuple[str, Sequence[Panel]]]) -> tuple[int, int]:
    cols = max(len(ps) for _, ps in rows)
    w, h = PANEL_INCHES
    return round(w * cols * DPI), round(h * len(rows) * DPI)


def draw(bundle: Bundle, path: str | Path) -> PlotResult:
    """Write the routing plot of `bundle` to `path` (PNG); a PlotResult without a path when the
    bundle has no routing metadata or matplotlib is missing."""
    rows = panels(bundle)
    if not rows:
        return PlotResult(note=None)
    if not matplotlib_available():
        return PlotResult(note=INSTALL_HINT)
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    width, height = figure_size(rows)
    cols = max(len(ps) for _, ps in rows)
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(rows), cols, squeeze=False)
    for r, (row_title, ps) in enumerate(rows):
        top = max((max(p.summary.counts, default=0) for p in ps), default=0) or 1
        for c in range(cols):
            ax = axes[r][c]
            if c >= len(ps):
                ax.set_axis_off()
                continue
            _panel(ax, ps[c], top)
            if c == 0:
                ax.set_ylabel("tokens", parse_math=False)
        axes[r][0].annotate(
            row_title,
            (0, 1.18),
            xycoords="axes fraction",
            fontsize=8,
            annotation_clip=False,
            parse_math=False,
        )
    out = Path(path)
    fig.savefig(out, format="png", dpi=DPI)
    return PlotResult(path=out, size=(width, height))


def _panel(ax: object, panel: Panel, top: int) -> None:
    s = panel.summary
    xs = list(range(len(s.groups)))
    colours = ["#c44e52" if n == 0 else "#4c72b0" for n in s.counts]
    ax.bar(xs, s.counts, color=colours)  # type: ignore[attr-defined]
    # Empty groups get a mark on the axis, so they are visible rather than missing bars.
    empty = [x for x, n in zip(xs, s.counts) if n == 0]
    if empty:
        ax.scatter(empty, [0] * len(empty), marker="x", color="#c44e52", zorder=3, clip_on=False)  # type: ignore[attr-defined]
    ax.set_ylim(0, top * 1.1)  # type: ignore[attr-defined]
    step = max(1, len(xs) // 16)
    ax.set_xticks(xs[::step], [str(g) for g in s.groups][::step], fontsize=7)  # type: ignore[attr-defined]
    xlabel = "group" if s.layout != "histogram" else "value"
    ax.set_xlabel(xlabel, parse_math=False)  # type: ignore[attr-defined]
    empties = f", {len(empty)} empty" if empty else ""
    title = f"{panel.title}: {s.tokens} tokens ({s.layout}{empties})"
    ax.set_title(title, fontsize=9, parse_math=False)  # type: ignore[attr-defined]


def plot_path(report_path: str | Path) -> Path:
    """Where the plot of a report written to `report_path` goes: beside it, `<stem>-routing.png`."""
    p = Path(report_path)
    return p.with_name(f"{p.stem}-routing.png")
