"""lab/profile_recorder.py's interleaved measurement, without a GPU: each round takes every
measurement in turn; the result is each one's median."""

from __future__ import annotations

from typing import Any


def test_interleaved_takes_every_measurement_in_turn_and_reports_medians(lab_import):
    order: list[str] = []
    values = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    def measure(name: str) -> Any:
        def take() -> float:
            order.append(name)
            return next(values[name])

        return take

    got = lab_import("profile_recorder").interleaved({"a": measure("a"), "b": measure("b")}, 3)
    assert order == ["a", "b"] * 3
    assert got == {"a": 3.0, "b": 4.0}
