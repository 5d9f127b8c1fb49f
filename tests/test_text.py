"""Strings from bundles are shown escaped, cut, and never interpreted."""

from __future__ import annotations

import io

from rich.console import Console

from kdump.text import markdown, markup, visible


def test_escape_sequences_become_visible() -> None:
    osc52 = "\x1b]52;c;ZWNobyBoaQ==\x07"
    clear = "\x1b[2J\x1b[H"
    shown = visible(f"a{osc52}b{clear}c\x9b")
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown
    assert (
        shown.startswith("a\\x1b]52;c;") and "\\x07b\\x1b[2J" in shown and shown.endswith("\\x9b")
    )


def test_lone_surrogates_and_bidi_overrides_are_escaped() -> None:
    shown = visible("x\ud800y\u202ez")
    assert shown == "x\\ud800y\\u202ez"
    shown.encode("utf-8")  # encodable: no UnicodeEncodeError at print time


def test_long_values_are_cut_with_a_marker() -> None:
    shown = visible("é" * 200_000, limit=100)
    assert shown == "é" * 100 + "…[199900 more characters]"


def test_newlines_kept_only_when_asked() -> None:
    assert visible("a\nb\tc") == "a\\nb\\tc"
    assert visible("a\nb\r", newlines=True) == "a\nb\\x0d"


def test_rich_markup_in_bundle_text_is_printed_literally() -> None:
    buf = io.StringIO()
    Console(file=buf, color_system=None, width=200).print(markup("[/] [/blue] [bold]x\x1b[0m"))
    assert buf.getvalue() == "[/] [/blue] [bold]x\\x1b[0m\n"


def test_markdown_syntax_is_escaped() -> None:
    assert markdown("a|b`c<script>") == "a\\|b\\`c\\<script\\>"
