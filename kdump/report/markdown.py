"""`kdump report`: a bundle as Markdown ready to paste into an issue."""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from kdump.bundle import Bundle, Call
from kdump.bundle.inspect import aliasing_groups
from kdump.kernels.plugin import RoutingSummary
from kdump.report.diff import alignment_class, flatten, scalar_arguments, show
from kdump.report.difftext import group_ids
from kdump.report.escape import code_fence, escape_md, escape_text
from kdump.report.plot import INSTALL_HINT, PlotResult, matplotlib_available
from kdump.report.redact import Redactor
from kdump.report.routing import routing_summaries

PRIVACY_NOTE = (
    "**Privacy.** A bundle holds the call's real tensors: activations are derived from the "
    "prompts that were served. This report and the bundle also carry host names, user names, "
    "paths and environment variable values; `kdump report --redact` replaces them in the report "
    "(the bundle itself is unchanged). Share the bundle only where its inputs may go."
)


@dataclass(frozen=True)
class ReportOptions:
    redact: bool = False
    modes: tuple[str, ...] = ("eager",)
    backend: str = "auto"
    device: str = "auto"
    plot: PlotResult | None = None  # the routing plot written beside the report, or why not
    script: str | None = None  # the standalone repro script written with --script
    paths: tuple[str, ...] = ()  # --path folders the replays import targets from


def _row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A Markdown table; cells must already be escaped."""
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows), ""]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Writer:
    def __init__(self, bundle: Bundle, shown_path: str, redactor: Redactor) -> None:
        self.bundle = bundle
        self.shown_path = shown_path
        self.r = redactor
        self.lines: list[str] = []

    def md(self, value: Any) -> str:
        return escape_md(self.r.text(value))

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    # --- sections ------------------------------------------------------------------------------
    def header(self) -> None:
        b = self.bundle
        self.add(f"# kdump report: {self.md(Path(self.shown_path).name)}", "", PRIVACY_NOTE, "")
        self.add("## Bundle", "")
        rows = [
            ["file", self.md(self.shown_path)],
            ["size", f"{b.file_size} bytes"],
            ["SHA-256", file_sha256(b.path)],
            ["format version", str(b.version)],
            ["calls", str(len(b.calls))],
        ]
        if b.manifest.created:
            rows.append(["created", self.md(b.manifest.created)])
        self.add(*table(["field", "value"], rows))

    def environment(self) -> None:
        env = dict(self.bundle.env)
        libraries = env.pop("libraries", None) or {}
        self.add("## Environment", "")
        if not env:
            self.add("The bundle recorded no environment.", "")
        else:
            rows = [
                [self.md(k), escape_md(self.r.env_value(k, v))] for k, v in flatten(env).items()
            ]
            self.add(*table(["key", "value"], rows))
        if libraries:
            self.add("### Library state and settings", "")
            rows = [[self.md(k), self.md(v)] for k, v in flatten(libraries).items()]
            self.add(*table(["setting", "value"], rows))

    def call(self, call: Call) -> None:
        self.add(f"### Call {call.index}: {self.md(call.target)}", "")
        if call.called_as != call.target:
            self.add(f"Called as {self.md(call.called_as)}.", "")
        if call.meta.get("capturing"):
            self.add("Recorded during CUDA-graph capture.", "")
        rows = []
        for name, rec in zip(call.tensor_names, call.tensors):
            lo, hi = rec.byte_extent()
            rows.append(
                [
                    self.md(name),
                    self.md(rec.dtype),
                    self.md(show(list(rec.shape))),
                    self.md(show(list(rec.stride))),
                    str(rec.storage_offset),
                    self.md(alignment_class(rec.data_ptr)),
                    str(hi - lo),
                    self.md(call.storages[rec.storage].device),
                    str(rec.storage),
                ]
            )
        header = ["argument", "dtype", "shape", "stride", "offset", "align", "bytes", "device"]
        self.add(*table([*header, "storage"], rows))
        groups = aliasing_groups(call)
        shared = "; ".join(" = ".join(self.md(n) for n in g) for g in groups)
        self.add(f"Shared storage (aliasing): {shared or 'none'}.", "")
        self.add(f"Outputs recorded: {'yes' if call.has_outputs else 'no'}.", "")
        scalars = scalar_arguments(self.bundle, call)
        if scalars:
            self.add(
                *table(
                    ["argument", "value"], [[self.md(k), self.md(v)] for k, v in scalars.items()]
                )
            )
        meta = flatten(call.meta)
        # The crash's multi-line text (traceback, tail of stderr) as code blocks after the
        # table: a table cell would hold it as one line of escapes. Other bundle strings stay
        # in cells, where nothing in them can start a line.
        blocks = {k: v for k, v in meta.items() if _BLOCK_KEYS.search(k) and "\n" in v.strip()}
        rows = [[self.md(k), self.md(v)] for k, v in meta.items() if k not in blocks]
        if blocks:
            rows += [[self.md(k), "(below)"] for k in blocks]
        if rows:
            self.add(*table(["meta", "value"], rows))
        for k, v in blocks.items():
            self.add(f"{self.md(k)}:", "", code_fence(self.block(v)), "")

    def block(self, text: str) -> str:
        """Multi-line bundle text for a code block: each line escaped (control characters,
        escape sequences), the lines kept."""
        return "\n".join(escape_text(self.r.text(line)) for line in text.strip("\n").split("\n"))

    def routing(self, plot: PlotResult | None = None) -> None:
        """One table per (target, routing argument): the calls of that target side by side."""
        by_key: dict[tuple[str, str], list[tuple[Call, RoutingSummary]]] = {}
        for call in self.bundle.calls:
            for s in routing_summaries(self.bundle, call):
                by_key.setdefault((call.target, s.argument), []).append((call, s))
        if not by_key:
            return
        self.add("## Routing metadata", "")
        for (target, argument), entries in by_key.items():
            layouts = ", ".join(sorted({s.layout for _, s in entries}))
            what = f"Argument {self.md(argument)} of {self.md(target)} ({self.md(layouts)})"
            self.add(f"{what}: tokens per group.", "")
            groups = sorted({g for _, s in entries for g in s.groups})
            header = ["group", *(f"call {c.index}" for c, _ in entries)]
            rows: list[list[Any]] = []
            for g in groups:
                rows.append([str(g), *(_cell(s.count(g)) for _, s in entries)])
            rows.append(["total", *(str(s.tokens) for _, s in entries)])
            rows.append(["padding rows", *(_cell(s.padding) for _, s in entries)])
            rows.append(["empty groups", *(group_ids(s.empty_groups) for _, s in entries)])
            if any(s.invalid for _, s in entries):
                rows.append(["invalid entries", *(str(s.invalid) for _, s in entries)])
            self.add(*table(header, rows))
        self.plot(plot)

    def plot(self, plot: PlotResult | None) -> None:
        if plot is not None and plot.path is not None and plot.size is not None:
            name = plot.path.name
            w, h = plot.size
            self.add(
                f"![Tokens per group of each routing argument]({quote(name)})",
                "",
                f"Plot: {escape_md(name)} ({w}×{h} pixels), tokens per group with empty groups "
                "marked, one panel per call; its data are the tables above.",
                "",
            )
        elif plot is not None and plot.note:
            self.add(plot.note, "")
        elif plot is None and not matplotlib_available():
            self.add(INSTALL_HINT, "")
        elif plot is None:
            self.add("A plot of these tables is written beside the report with `-o FILE.md`.", "")

    def verdicts(self, verdicts: Sequence[Any]) -> None:
        self.add("## Replay verdicts", "")
        rows = [
            [
                self.md(v.mode),
                str(v.call),
                self.md(v.backend or "-"),
                self.md(v.device or "-"),
                str(v.exit_code),
                self.md(v.headline()),
            ]
            for v in verdicts
        ]
        self.add(*table(["mode", "call", "backend", "device", "exit", "verdict"], rows))
        for v in verdicts:
            for f in v.findings:
                where = f"{self.md(v.mode)} call {v.call}, {self.md(f.kind)} at {self.md(f.step)}"
                self.add(f"- {where}: {self.md(f.message)}")
            for n in v.notes:
                self.add(f"- {self.md(v.mode)} call {v.call}: {self.md(n)}")
        self.add("")

    def reproduce(self, options: ReportOptions) -> None:
        """Commands that work as printed: `--allow-target` for each target no plug-in claims,
        `--path` for each folder given, and a note for a target module not importable here."""
        from kdump.doctor import path_hint, replay_words

        def shown(text: str) -> str:
            return shlex.quote(escape_text(self.r.text(text)))

        path = shown(self.shown_path)
        backend = "" if options.backend == "auto" else f" --backend {shlex.quote(options.backend)}"
        device = "" if options.device == "auto" else f" --device {shlex.quote(options.device)}"
        words, missing = replay_words(
            [c.target for c in self.bundle.calls], paths=[str(p) for p in options.paths]
        )
        needs = "".join(f" {shown(w)}" for w in words)
        cmds = [f"kdump info {path} --verify"]
        if missing:
            cmds.append(f"# {escape_text(self.r.text(path_hint(missing)))}")
        for mode in ("eager", "graph", "sanitizer"):
            cmds.append(f"kdump replay {path} --mode {mode}{backend}{device}{needs}")
        if len(self.bundle.calls) > 1:
            first, second = self.bundle.calls[0].index, self.bundle.calls[1].index
            cmds.append(f"kdump diff {path}#{first} {path}#{second}")
        if options.script:
            run = "".join(f" --path {shown(str(p))}" for p in options.paths)
            cmds.append(
                f"python {shown(options.script)}{run}"
                "  # standalone: torch and the kernel library, no kdump"
            )
        self.add("## Reproduce", "", code_fence("\n".join(cmds)), "")


# Flattened meta keys whose multi-line text is shown as a code block.
_BLOCK_KEYS = re.compile(r"^crash\.|^exception$|traceback$")


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def render_report(
    bundle: Bundle,
    shown_path: str | None = None,
    verdicts: Sequence[Any] = (),
    options: ReportOptions | None = None,
) -> str:
    """The Markdown report of `bundle`; `verdicts` (from kdump.replay.replay) add a section."""
    options = options or ReportOptions()
    redactor = Redactor.from_env([bundle.env], options.redact, [c.meta for c in bundle.calls])
    w = _Writer(bundle, redactor.path(shown_path or str(bundle.path)), redactor)
    w.header()
    w.environment()
    w.add("## Calls", "")
    for call in bundle.calls:
        w.call(call)
    w.routing(options.plot)
    if verdicts:
        w.verdicts(verdicts)
    w.reproduce(options)
    return "\n".join(w.lines).rstrip() + "\n"
