"""The selftest's cases are valid calls: generated and replayed clean on the CPU reference (the
packaged kernel replays them in `kdump doctor --selftest` on a GPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kdump.doctor import SELFTEST_CASES, selftest_bundles
from kdump.replay import replay


def test_selftest_cases_replay_clean_on_the_reference(tmp_path) -> None:
    bundles = selftest_bundles(tmp_path, "cpu")
    assert [label for label, _ in bundles] == [c[0] for c in SELFTEST_CASES]
    layouts = set()
    for label, path in bundles:
        verdicts = replay([path], backend="reference", device="cpu", repeat=1, isolate=False)
        assert [v.exit_code for v in verdicts] == [0], (label, [v.headline() for v in verdicts])
        layouts.add(label.split()[0])
    assert layouts == {"labels", "psum", "masked"}
