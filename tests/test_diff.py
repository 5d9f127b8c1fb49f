"""`kdump diff`: what differs between two calls, on the sample captures and crafted bundles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdump.bundle import capture_call, load_bundle, save_calls
from kdump.cli import main
from kdump.report.diff import LAYOUT_SECTIONS, alignment_class, diff_calls

CAPTURES = Path(__file__).resolve().parent.parent / "captures"
HOSTILE = "evil\x1b[31m|`tick`|[bold]red[/]<b>\u202e"
GEN = torch.Generator().manual_seed(7)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def _diff(a: str, b: str):
    ba, bb = load_bundle(CAPTURES / a), load_bundle(CAPTURES / b)
    return diff_calls(ba, ba.calls[0], bb, bb.calls[0])


def _labels_counts(name: str) -> list[int]:
    call = load_bundle(CAPTURES / name).calls[0]
    labels = call.args[3]  # grouped_layout, the fourth positional argument
    groups = call.args[1][0].shape[0]
    return torch.bincount(labels[labels >= 0].long(), minlength=groups).tolist()


def test_routing_pair_differs_only_in_routing() -> None:
    d = _diff("contiguous_ue8m0.kdump", "contiguous_ue8m0_b.kdump")
    assert d.in_section(*LAYOUT_SECTIONS, "target", "argument", "env", "library") == []
    ca, cb = _labels_counts("contiguous_ue8m0.kdump"), _labels_counts("contiguous_ue8m0_b.kdump")
    changed = [g for g in range(len(ca)) if ca[g] != cb[g]]
    assert changed  # the pair was made with different distributions
    routing = {x.item: (x.a, x.b) for x in d.in_section("routing")}
    expected = {f"grouped_layout group {g}": (str(ca[g]), str(cb[g])) for g in changed}
    pad_a = int((load_bundle(CAPTURES / "contiguous_ue8m0.kdump").calls[0].args[3] == -1).sum())
    pad_b = int((load_bundle(CAPTURES / "contiguous_ue8m0_b.kdump").calls[0].args[3] == -1).sum())
    expected["grouped_layout padding"] = (str(pad_a), str(pad_b))
    assert routing == expected
    [r] = d.routing
    assert list(r.changed) == changed
    assert r.a.empty_groups == tuple(g for g, c in enumerate(ca) if c == 0)
    assert r.b.empty_groups == tuple(g for g, c in enumerate(cb) if c == 0)


def test_other_layouts_show_shape_and_argument_differences() -> None:
    d = _diff("contiguous_ue8m0.kdump", "contiguous_psum_fp32.kdump")
    tensors = {x.item: (x.a, x.b) for x in d.in_section("tensor")}
    assert tensors["grouped_layout shape"] == ("[640]", "[6]")
    assert tensors["a[1] dtype"] == ("int32", "float32")
    args = {x.item: (x.a, x.b) for x in d.in_section("argument")}
    assert args["use_psum_layout"] == ("false", "true")
    assert [r.b.layout for r in d.routing] == ["psum"]

    m = _diff("contiguous_ue8m0.kdump", "masked_ue8m0.kdump")
    assert {x.item for x in m.in_section("target")} == {"target"}
    items = {x.item: (x.a, x.b) for x in m.in_section("tensor")}
    assert items["a[0] shape"] == ("[640, 512]", "[6, 128, 512]")
    assert items["masked_m"] == ("-", "present") and items["grouped_layout"] == ("present", "-")
    assert m.routing == ()  # different routing arguments are not compared group by group


def test_same_call_is_identical_and_cli_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(CAPTURES / "masked_ue8m0.kdump")
    assert _diff("masked_ue8m0.kdump", "masked_ue8m0.kdump").identical
    code, out, _ = run(capsys, "diff", path, path + "#0")
    assert code == 0 and "identical" in out


def test_cli_exit_zero_when_different_and_fits_80_columns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = CAPTURES / "contiguous_ue8m0.kdump", CAPTURES / "contiguous_psum_fp32.kdump"
    code, out, _ = run(capsys, "diff", str(a), str(b))
    assert code == 0
    assert "grouped_layout shape: [640] -> [6]" in out
    assert max(len(line) for line in out.splitlines()) <= 80
    code, out, _ = run(capsys, "diff", str(a), str(b), "--json")
    assert code == 0 and '"identical": false' in out


def test_cli_bad_bundle_and_bad_call_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = str(CAPTURES / "masked_ue8m0.kdump")
    junk = tmp_path / "junk.kdump"
    junk.write_bytes(
        torch.randint(0, 255, (64,), dtype=torch.uint8, generator=GEN).numpy().tobytes()
    )
    for other in (str(junk), good + "#5", good + "#x", str(tmp_path / "missing.kdump")):
        code, _, err = run(capsys, "diff", good, other)
        assert code == 2, (other, err)
        assert err.startswith("kdump: error:") or "Error" in err


def _offset_bundle(path: Path, offset: int, target: str, env: dict) -> Path:
    base = torch.randn(40, generator=GEN)
    x = base[offset : offset + 32].view(4, 8)
    rec = capture_call(target, [x, 3], {"flag": "on"}, names=["x", "n"])
    return save_calls(path, [rec], env=env)


def test_alignment_and_offset_differences(tmp_path: Path) -> None:
    assert alignment_class(0x7F00_0000_1000) == ">=16"
    assert alignment_class(0x7F00_0000_1008) == "8"
    assert alignment_class(0x7F00_0000_1001) == "1"
    a = load_bundle(_offset_bundle(tmp_path / "a.kdump", 0, "m:f", {"torch": "2.4"}))
    b = load_bundle(_offset_bundle(tmp_path / "b.kdump", 1, "m:f", {"torch": "2.5"}))
    d = diff_calls(a, a.calls[0], b, b.calls[0])
    tensors = {x.item: (x.a, x.b) for x in d.in_section("tensor")}
    assert tensors["x offset"] == ("0", "1")
    assert tensors["x alignment"][1] == "4"  # one float32 past a 16-byte aligned start
    assert {x.item: (x.a, x.b) for x in d.in_section("env")} == {"torch": ("2.4", "2.5")}


def test_hostile_strings_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {"hostname": HOSTILE, "env_vars": {"K": HOSTILE}}
    a = _offset_bundle(tmp_path / "a.kdump", 0, "mod:" + HOSTILE, env)
    b = _offset_bundle(tmp_path / "b.kdump", 0, "mod:plain", {"hostname": "ok"})
    code, out, _ = run(capsys, "diff", str(a), str(b))
    assert code == 0
    assert "\x1b" not in out and "\u202e" not in out
    assert "\\x1b[31m" in out and "\\u202e" in out
    assert "[bold]red[/]" in out  # shown literally, never interpreted as markup
    assert max(len(line) for line in out.splitlines()) <= 80
