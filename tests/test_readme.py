"""The README as a newcomer reads it: its own-function recipe runs as written on the CPU (the
files it shows are written into an empty folder, its commands run there with this checkout's
kdump, and what it shows the user is what they see), the README stays short, every option its
`kdump` commands and the docs' use exists, and every link to a file of the repository resolves.

The recipe is found by HTML comment markers in README.md, each right above a fenced block:
`<!-- recipe: file NAME -->` (write the block to NAME), `<!-- recipe: run -->` or
`<!-- recipe: run, exits N -->` (a console block: lines starting with `$ ` are commands, the lines
after one are what it prints, `...` standing for anything, HOST and PID for the host name and a
process id) and `<!-- recipe: api -->` (a Python program run beside the first version of the
files, printing what its last line's comment says)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import kdump
from kdump.errors import ExitCode

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = 250

MARKER = re.compile(r"^<!-- recipe: (?P<what>[^>]*?) -->\n```\w*\n(?P<body>.*?)^```$", re.M | re.S)
FENCE = re.compile(r"^```\w*\n(?P<body>.*?)^```$", re.M | re.S)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`\n]*`")


@dataclass
class Step:
    """One marked block of the recipe."""

    what: str  # "file NAME", "run", "run, exits N" or "api"
    body: str

    @property
    def expected_exit(self) -> int:
        m = re.fullmatch(r"run(?:, exits (\d+))?", self.what)
        assert m, f"unknown recipe marker {self.what!r}"
        return int(m.group(1) or 0)


@dataclass
class Command:
    line: str
    shown: list[str] = field(default_factory=list)  # the output lines the README shows


def recipe(text: str) -> list[Step]:
    return [Step(m["what"].strip(), m["body"]) for m in MARKER.finditer(text)]


def commands(console: str) -> list[Command]:
    out: list[Command] = []
    for line in console.splitlines():
        if line.startswith("$ "):
            out.append(Command(line[2:]))
        else:
            assert out, f"output before any command: {line!r}"
            out[-1].shown.append(line)
    return out


def shown_pattern(line: str) -> re.Pattern[str]:
    """A line the README shows, as a pattern over whitespace-normalised output: `...` is
    anything, HOST a host name, PID a process id; rich may wrap a table cell anywhere."""
    parts = re.split(r"(\.\.\.|HOST|PID)", " ".join(line.split()))
    wild = {"...": ".*?", "HOST": r"[^/\s]+", "PID": r"\d+"}
    return re.compile("".join(wild.get(p) or re.escape(p).replace(r"\ ", r"\s*") for p in parts))


def expect_shown(shown: list[str], got: str) -> None:
    """Every shown line appears in the output, in the README's order."""
    flat = " ".join(got.split())
    pos = 0
    for line in shown:
        if line.strip() in ("", "..."):
            continue
        m = shown_pattern(line).search(flat, pos)
        assert m, f"the README shows {line!r}, the command printed:\n{got}"
        pos = m.end()


def argv(line: str) -> list[str]:
    """The command as this checkout runs it: `kdump` and `python` are the venv's."""
    words = shlex.split(line)
    words = [sys.executable if w == "python" else w for w in words]
    if words[0] == "kdump":
        words = [sys.executable, "-m", "kdump", *words[1:]]
    return words


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A user's shell: no kdump settings or config, a private journal folder and a short TMPDIR
    (the salvage process' socket path must stay under 108 bytes), a wide terminal."""
    short = Path(tempfile.mkdtemp(prefix="kd-", dir="/tmp"))
    (tmp_path / "shm").mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("KDUMP_")}
    old = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    kdump_root = str(Path(kdump.__file__).resolve().parent.parent)
    base.update(
        PYTHONPATH=os.pathsep.join([kdump_root, *old]),
        TMPDIR=str(short),
        KDUMP_JOURNAL_DIR=str(tmp_path / "shm"),
        KDUMP_CONFIG=str(tmp_path / "none.toml"),
        COLUMNS="200",
    )
    yield base
    shutil.rmtree(short, ignore_errors=True)


def _run(line: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv(line), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_own_function_recipe_runs_as_written(tmp_path: Path, env: dict[str, str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    steps = recipe(README.read_text())
    files: dict[str, list[str]] = {}
    ran: list[tuple[list[str], int]] = []
    for step in steps:
        if step.what.startswith("file "):
            name = step.what.split(" ", 1)[1]
            (work / name).write_text(step.body)
            files.setdefault(name, []).append(step.body)
        elif step.what.startswith("run"):
            for cmd in commands(step.body):
                r = _run(cmd.line, work, env)
                got = r.stdout + r.stderr  # the program's output first, then kdump's lines
                assert r.returncode == step.expected_exit, (cmd.line, got)
                expect_shown(cmd.shown, got)
                ran.append((shlex.split(cmd.line), r.returncode))
    # The recipe itself: a function and its program, recorded with `kdump record -t mod:fn`,
    # replayed clean; the function changed, the same replay fails with wrong results.
    assert set(files) == {"mymod.py", "prog.py"} and len(files["mymod.py"]) == 2, list(files)
    assert files["mymod.py"][0] != files["mymod.py"][1]
    assert [(words[:3], rc) for words, rc in ran] == [
        (["kdump", "record", "-t"], ExitCode.CLEAN),
        (["kdump", "replay", "dumps/"], ExitCode.CLEAN),
        (["kdump", "replay", "dumps/"], ExitCode.MISMATCH),
    ]
    assert ran[0][0][3] == "mymod:myfn" and ran[1][0] == ran[2][0]


def test_the_python_recipe_runs_as_written(tmp_path: Path, env: dict[str, str]) -> None:
    steps = recipe(README.read_text())
    first = {}
    for step in steps:
        if step.what.startswith("file "):
            first.setdefault(step.what.split(" ", 1)[1], step.body)
    (api,) = [s.body for s in steps if s.what == "api"]
    for name, body in first.items():
        (tmp_path / name).write_text(body)
    (tmp_path / "api.py").write_text(api)
    r = _run("python api.py", tmp_path, env)
    assert r.returncode == 0, r.stderr
    said = api.rstrip().splitlines()[-1].split("# ", 1)[1]
    assert r.stdout.strip() == said
    assert list((tmp_path / "dumps-api").glob("*/myfn-*.kdump"))


def test_the_output_check_can_fail() -> None:
    printed = "dumps/flight.vm/journal-17-call-000000-seq1.kdump call 0 mymod:myfn: eager\n"
    printed += "verdict: clean\n (exit 0)\n\n3 replays: 3 clean: exit 0\n"
    expect_shown(
        ["dumps/flight.HOST/journal-PID-call-...", "...", "verdict: clean (exit 0)"], printed
    )
    for wrong in (
        ["verdict: mismatch (exit 1)"],
        ["3 replays: 3 clean: exit 0", "verdict: clean (exit 0)"],  # out of order
        ["dumps/flight.HOST/journal-PID-call-000001"],
    ):
        with pytest.raises(AssertionError):
            expect_shown(wrong, printed)
    with pytest.raises(AssertionError):
        Step("run, exits one", "").expected_exit  # noqa: B018


def test_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines, at most {MAX_LINES}"


def _kdump_lines(text: str) -> Iterator[str]:
    """Every `kdump COMMAND ...` in the text's fenced blocks (continuations joined, comments and
    the program after `--` dropped)."""
    for m in FENCE.finditer(text):
        body = m["body"].replace("\\\n", " ")
        for line in body.splitlines():
            line = line.removeprefix("$ ")
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            for i, w in enumerate(words[:-1]):
                if w.endswith("kdump") and not words[i + 1].startswith("-"):
                    rest = words[i + 1 :]
                    for stop in ("--", "&&", "|"):
                        rest = rest[: rest.index(stop)] if stop in rest else rest
                    yield " ".join(rest)
                    break


def test_every_option_shown_exists() -> None:
    import click

    from kdump.cli import cli

    ctx = click.Context(cli)
    seen = 0
    for path in [README, *DOCS]:
        for line in _kdump_lines(path.read_text()):
            name, *rest = line.split()
            command = cli.get_command(ctx, name)
            if command is None:
                continue
            known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
            for word in rest:
                if word.startswith("-"):
                    assert word.split("=")[0] in known, f"{path.name}: kdump {line}: {word}"
                    seen += 1
    assert seen > 30


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m[1]) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def test_links_to_repository_files_and_sections_resolve() -> None:
    assert slug("11.1 Trust") == "111-trust"
    assert slug("Journal (flight recorder)") == "journal-flight-recorder"
    for path in [README, *DOCS]:
        prose = CODE_SPAN.sub("", path.read_text())  # `kernel[grid](x)` is code, not a link
        for m in LINK.finditer(prose):
            target, _, anchor = m["target"].partition("#")
            if "://" in target:
                continue
            dest = (path.parent / target) if target else path
            assert dest.exists(), f"{path.name}: link to {target}"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors(dest), f"{path.name}: no section #{anchor} in {target}"


def test_paths_named_in_code_spans_exist() -> None:
    """A module, folder or benchmark the README or the docs name in `code` is still there (the
    tree moves; the text must follow)."""
    repo_path = re.compile(r"`((?:kdump|bench|examples|captures|docs|tests|lab|scripts)/[^`\s]*)`")
    bench = re.compile(r"`(bench_\w+\.py)`")
    for path in [README, *DOCS]:
        text = path.read_text()
        for name in repo_path.findall(text):
            assert (ROOT / name).exists(), f"{path.name} names {name}"
        for name in bench.findall(text):
            assert (ROOT / "bench" / name).exists(), f"{path.name} names bench/{name}"
