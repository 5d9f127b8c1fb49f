"""Recording hygiene: lazy conj / neg views, `__torch_function__` subclasses, temporaries."""

from __future__ import annotations

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
