"""Recording hygiene: lazy conj / neg views, `__torch_function__` subclasses, temporaries."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import kdump
from kdump.bundle import load_bundle


def _pair(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.real.sum() + y.sum()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg().contiguous().view(torch.uint8)


def test_conj_and_neg_views_record_the_values_the_kernel_saw(tmp_path) -> None:
    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.complex(
        torch.randn(5, 3, generator=g, device="cpu"), torch.randn(5, 3, generator=g, device="cpu")
    ).t()  # a transposed layout, non-zero imaginary parts
    y = torch.randn(4, 6, generator=g, device="cpu")[:, 1:5]
    xc, yn = x.conj(), y._neg_view()
    assert xc.is_conj() and yn.is_neg()
    raw_x = x.clone()
    kdump.dump_call(tmp_path / "one.kdump", _pair, xc, yn)
    assert xc.is_conj() and yn.is_neg() and torch.equal(x, raw_x)  # the arguments are untouched
    call = load_bundle(tmp_path / "one.kdump").calls[0]
    got_x, got_y = call.args
    assert not got_x.is_conj() and not got_y.is_neg()
    assert got_x.stride() == xc.stride() and got_y.stride() == yn.stride()
    assert torch.equal(_bits(got_x), _bits(x.conj().resolve_conj()))
    assert torch.equal(_bits(got_y), _bits(y._neg_view().resolve_neg()))
    assert not torch.equal(_bits(got_x), _bits(x))  # the stored values are not the raw storage


class Counting(torch.Tensor):
    """A `__torch_function__` subclass that counts every torch call it sees."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Counting.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


PROGRAM = """
def affine(x, out):
    out.copy_(x * 3.0 + 1.0)
    return out.sum()
"""


@pytest.fixture
def progmod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "hyg_prog.py").write_text(PROGRAM)
    monkeypatch.syspath_prepend(str(mod))
    sys.modules.pop("hyg_prog", None)
    yield importlib.import_module("hyg_prog")
    sys.modules.pop("hyg_prog", None)


def _counted_call(fn, *args) -> int:
    before = Counting.calls
    fn(*args)
    return Counting.calls - before


def _counting_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(8, 5, generator=g, device="cpu").as_subclass(Counting)
    out = torch.randn(8, 5, generator=g, device="cpu").as_subclass(Counting)
    return x, out


def test_recording_adds_no_torch_function_calls(progmod, tmp_path: Path) -> None:
    plain = _counted_call(progmod.affine, *_counting_inputs(1))
    assert plain > 0
    with kdump.recording("hyg_prog:affine", out=tmp_path / "rec") as rec:
        recorded = _counted_call(progmod.affine, *_counting_inputs(2))
    assert len(rec.written) == 1
    assert recorded == plain
    one = _counted_call(
        lambda *a: kdump.dump_call(tmp_path / "one.kdump", progmod.affine, *a),
        *_counting_inputs(3),
    )
    assert one == plain
    for path in (rec.written[0], tmp_path / "one.kdump"):
        call = load_bundle(path).calls[0]
        assert call.outputs is not None and len(call.outputs) >= 1
