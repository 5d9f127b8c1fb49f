"""Targets whose spec names raw-pointer parameters (DeepGEMM's mega-MoE `sym_buffer_ptrs`): the
recorder is handed `Pointer`s for them, the kernel still gets the integers the program passed."""

from __future__ import annotations

from typing import Any

from kdump.format.argtree import Pointer
from kdump.kernels.plugin import TargetSpec
from kdump.record.hooks import HookState, make_call_wrapper


def mega(x: Any, sym_buffer_ptrs: list[int], rank: int = 0) -> tuple[Any, list[int], int]:
    return x, sym_buffer_ptrs, rank


def _hooked(pointer_params: tuple[str, ...]) -> tuple[Any, list[Any]]:
    seen: list[Any] = []

    def handler(st: Any, i: int, called_as: str, fn: Any, args: Any, kwargs: Any) -> Any:
        seen.append((args, kwargs))
        return fn(*args, **kwargs)

    spec = TargetSpec("m", "mega", "m:mega", pointer_params=pointer_params)
    st = HookState(spec, mega, handler, consider=lambda i: True)
    return make_call_wrapper(st, "m:mega", mega), seen


def test_pointer_params_reach_the_recorder_as_pointers_and_the_kernel_as_integers() -> None:
    hook, seen = _hooked(("sym_buffer_ptrs",))
    ptrs = [0x7F0000001000, 0x7F0000002000]
    got = hook("x", ptrs, rank=1)
    assert got == ("x", ptrs, 1) and got[1] is ptrs  # the program's own list, untouched
    (args, kwargs) = seen[0]
    assert args[1] == [Pointer(0x7F0000001000), Pointer(0x7F0000002000)]
    assert args[0] == "x" and kwargs == {"rank": 1}  # other parameters as passed
    got = hook("x", sym_buffer_ptrs=(5,))
    assert got[1] == (5,) and seen[1][1] == {"sym_buffer_ptrs": (Pointer(5),)}


def test_targets_without_pointer_params_are_passed_through_unchanged() -> None:
    hook, seen = _hooked(())
    ptrs = [1, 2]
    hook("x", ptrs)
    assert seen[0][0][1] is ptrs
