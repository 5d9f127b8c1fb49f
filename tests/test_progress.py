"""kdump.progress: plain lines off a terminal (rate-limited, no escapes), silence when disabled,
and the CLI commands that use it."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
import torch

from kdump.cli import main
from kdump.progress import progress

CAPTURES = Path(__file__).resolve().parent.parent / "captures"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_at_most_per_tenth_without_escapes() -> None:
    out, clock = io.StringIO(), Clock()
    with progress("replay \x1b[31mdumps", 100, stream=out, clock=clock) as bar:
        for _ in range(100):
            bar.advance()
    lines = out.getvalue().splitlines()
    assert lines == [f"replay \\x1b[31mdumps: {n}/100 ({n}%)" for n in range(10, 101, 10)]
    assert "\x1b" not in out.getvalue()


def test_plain_lines_by_time_when_steps_are_small() -> None:
    out, clock = io.StringIO(), Clock()
    with progress("pack", 1000, stream=out, clock=clock) as bar:
        for _ in range(30):
            clock.now += 1.0
            bar.advance()
    # 30 steps are 3 % of the total: only the 5-second rule and the last line print.
    assert out.getvalue().splitlines() == [
        "pack: 5/1000 (0%)",
        "pack: 10/1000 (1%)",
        "pack: 15/1000 (1%)",
        "pack: 20/1000 (2%)",
        "pack: 25/1000 (2%)",
        "pack: 30/1000 (3%)",
    ]


def test_unknown_total_and_no_work() -> None:
    out, clock = io.StringIO(), Clock()
    with progress("scan", None, stream=out, clock=clock) as bar:
        bar.advance(3)
    assert out.getvalue() == "scan: 3\n"
    out = io.StringIO()
    with progress("scan", 5, stream=out, clock=clock):
        pass
    assert out.getvalue() == ""


def test_disabled_prints_nothing_even_on_a_tty() -> None:
    out = Tty()
    with progress("replay", 4, enabled=False, stream=out) as bar:
        for _ in range(4):
            bar.advance()
    assert out.getvalue() == "" and bar.done == 4


def test_rich_bar_on_a_tty() -> None:
    out = Tty()
    with progress("replay", 3, stream=out) as bar:
        for _ in range(3):
            bar.advance()
    assert "\x1b" in out.getvalue()  # a live bar draws with escape sequences


def test_replay_of_a_folder_reports_progress_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("masked_ue8m0.kdump", "contiguous_fp32.kdump"):
        shutil.copy(CAPTURES / name, tmp_path / name)
    argv = ["replay", str(tmp_path), "--backend", "reference", "--device", "cpu", "--in-process"]
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("replay ")]
    assert lines == [f"replay {tmp_path}: 1/2 (50%)", f"replay {tmp_path}: 2/2 (100%)"]
    assert "\x1b" not in err
    for flag in ("--json", "--quiet"):
        code, _, err = run(capsys, *argv, flag)
        assert code == 0 and "replay " not in err, err


@pytest.mark.parametrize("quiet", [False, True])
def test_pack_reports_progress_unless_quiet(
    tmp_path: Path, quiet: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "dumps"
    src.mkdir()
    for name in ("masked_ue8m0.kdump", "contiguous_fp32.kdump"):
        shutil.copy(CAPTURES / name, src / name)
    code, _, err = run(capsys, "pack", str(src), *(["--quiet"] if quiet else []))
    assert code == 0, err
    plain = [ln for ln in err.splitlines() if ln.startswith("pack ")]
    from kdump.bundle.packing import packed_bytes

    mb = sum(packed_bytes(p) for p in src.iterdir()) / 1e6
    if quiet:
        assert plain == []
    else:  # bytes of both bundles on one bar
        assert len(plain) >= 2 and plain[-1] == f"pack {src}: {mb:.1f}/{mb:.1f} MB (100%)"


def test_pack_of_one_big_bundle_reports_the_bytes_as_they_are_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bundle of at least BIG_BYTES gets a bar in MB, advanced piece by piece of each blob
    (here with the thresholds scaled down to a sample capture)."""
    from kdump import progress as progress_mod
    from kdump.bundle import packing, writer

    src = CAPTURES / "contiguous_fp32.kdump"
    total = packing.packed_bytes(src)
    monkeypatch.setattr(progress_mod, "BIG_BYTES", total)
    monkeypatch.setattr(writer, "ONE_WRITE_MAX", 0)  # the streamed write, as for a big bundle
    monkeypatch.setattr(writer, "PROGRESS_CHUNK", max(1, total // 40))
    code, _, err = run(capsys, "pack", str(src), "-o", str(tmp_path / "p.kdump"))
    assert code == 0, err
    plain = [ln for ln in err.splitlines() if ln.startswith("pack ")]
    assert len(plain) >= 5, err  # a line per tenth of the bytes, not one per bundle
    percents = [int(ln.rsplit("(", 1)[1].rstrip("%)")) for ln in plain]
    assert percents == sorted(percents) and percents[-1] == 100
    assert plain[-1] == f"pack {src}: {total / 1e6:.1f}/{total / 1e6:.1f} MB (100%)"
    code, _, err = run(capsys, "replay", str(tmp_path / "p.kdump"), "-q")
    assert code == 0, err


def test_quiet_for_keeps_short_work_silent() -> None:
    out, clock = io.StringIO(), Clock()
    with progress("salvage", 3, stream=out, clock=clock, quiet_for=5.0) as bar:
        for _ in range(3):
            bar.advance()
            clock.now += 1.0
    assert out.getvalue() == ""
    with progress("salvage", 3, stream=out, clock=clock, quiet_for=5.0) as bar:
        bar.advance()
        clock.now += 6.0
        bar.advance()
        bar.advance()
    assert out.getvalue().splitlines() == ["salvage: 2/3 (66%)", "salvage: 3/3 (100%)"]


def rowsum(a: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(a.sum(1))


def test_salvage_advances_a_bar_per_call_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The salvage after a run (and `kdump salvage`) shows its progress per call written: the
    bar's total grows by each journal's complete calls."""
    import kdump
    from kdump.progress import Bar
    from kdump.record.config import RingConfig
    from kdump.record.flight.salvage import salvage_journal

    monkeypatch.setenv("KDUMP_RECORD", "1")  # as under `kdump record`: the journal stays
    ring = RingConfig(slots=8, slot_bytes=256 << 10, journal_dir=tmp_path / "shm")
    with kdump.recording(f"{__name__}:rowsum", out=tmp_path / "o", mode="ring", ring=ring):
        fn = sys.modules[__name__].rowsum  # the hooked attribute
        for _ in range(5):
            fn(torch.randn(16, 8), torch.zeros(16))
    journals = [p for p in (tmp_path / "shm").glob("kdump-journal-*") if "." not in p.name]
    bar = Bar("salvage", None)
    res = salvage_journal(journals[0], tmp_path / "salvaged", progress=bar)
    assert len(res.bundles) == 5 and bar.total == 5 and bar.done == 5
