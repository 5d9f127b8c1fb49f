"""kdump's synthetic-data generator: known-answer bytes for every dtype (the same on every
machine and torch version), exact encodings, statistics, and refusals."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kdump.format import synthetic
from kdump.format.synthetic import DTYPES, Params, generate, refusal

# First 16 bytes and SHA-256 of 4096 bytes of Params(seed=7, dtype, min=-4, max=4, mean=0.5,
# std=1.5). A change here changes every slimmed bundle: it needs a new generator version.
KNOWN = {
    "bfloat16": (
        "b1be05bf1f3f2e3fc0bfd73f953f643f",
        "562c199e3d386227faf2e4c2d33c3a65eddc20fa91e014aabcfd36c64c0b986b",
    ),
    "bool": (
        "00000101000101010000010001010000",
        "e9f51eee909e8d89e93ed8015bb1ff245045008e1890ff4ef189356fd8f8da9e",
    ),
    "float16": (
        "86b529b8f5387039fdbdb73ea53c1c3b",
        "3d1dbaadcd21c383c9480069aaf4ec60f7126170df978cb2cdceca05ee05285e",
    ),
    "float32": (
        "94b3b0be192305bfcaa81e3f14012e3f",
        "8aaf2f8cf68b3f78b06768ef77797d737b1e64f611e7f49f58fba7b4e1f638d2",
    ),
    "float64": (
        "00f6a0797216d6bf6429f62a63a4e0bf",
        "52af1ef746b97c2623cd612c8b23df2b31474b39dc1cba37015121c5dcbcff37",
    ),
    "float8_e4m3fn": (
        "abb03233bc3d393626283009393eb1a3",
        "e196f904020417f88b449bbfd4f738d4bc06191629e01d3e0b6d01ba9f47a148",
    ),
    "float8_e5m2": (
        "b6b83939be3f3d3b333438253c3fb8b2",
        "cbb57e0e2b046404826a61bcd11c063049ab5a5cf225ab43a7363afe521f05c0",
    ),
    "float8_e8m0fnu": (
        "00007e7e007f7f7e7c7d7e797f7f0000",
        "936ca5b9ee72aa802e758c281488b9a51d6b2dc7ac6d21cc10c7997fcc48a7bc",
    ),
    "int16": (
        "0000ffff01000100ffff020001000100",
        "e944ad05afbac84cc8614656597b419515d42add03fec2a25223981ac922ae83",
    ),
    "int32": (
        "00000000ffffffff0100000001000000",
        "98c75a3f2f70d78eee4f2ee216c4f8824e340ce97dac96d457901c820ca17752",
    ),
    "int64": (
        "0000000000000000ffffffffffffffff",
        "46922e9947575cd0f92d89cd6a87d68e5d2ebc3cef9385eb37e0d01c492b4a6d",
    ),
    "int8": (
        "00ff0101ff020101000001000102ff00",
        "d2c73fb899c1a73fa85d241f7b875d217b73c5b7b97ea0389bf4367cfb251673",
    ),
    "uint16": (
        "00000000010001000000020001000100",
        "d4f78a01982f69853f2871937c727af5a57dd24a561c98dea50dae6ac49ad1ea",
    ),
    "uint32": (
        "00000000000000000100000001000000",
        "062800c68c7ebb1c4de43c86da24d8127feff8fa999c4c0d6dd7b554fa734196",
    ),
    "uint64": (
        "00000000000000000000000000000000",
        "5eab170ae3db2a33d4948f5c662db4db7866945354baf91098120a094f6b05ef",
    ),
    "uint8": (
        "00000101000201010000010001020000",
        "061d109fcaf3bd12ce5bf6782087f41a7c6ab9bee8c164163509cb8108ff1fb2",
    ),
}


def test_known_answer_bytes_for_every_dtype() -> None:
    assert set(KNOWN) == set(DTYPES)
    for dtype, (head, digest) in KNOWN.items():
        got = generate(Params(7, dtype, -4.0, 4.0, 0.5, 1.5), 4096).tobytes()
        assert got[:16].hex() == head, dtype
        assert hashlib.sha256(got).hexdigest() == digest, dtype


def test_bytes_do_not_depend_on_size_or_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Params(99, "bfloat16", -2.0, 2.0, 0.0, 1.0)
    whole = generate(p, 10_001).tobytes()
    assert generate(p, 333).tobytes() == whole[:333]  # odd size: cut inside an element
    monkeypatch.setattr(synthetic, "_CHUNK", 7)
    assert generate(p, 10_001).tobytes() == whole


def test_splitmix64_reference_values() -> None:
    # SplitMix64's reference outputs for seed 0.
    got = [int(w) for w in synthetic.splitmix64(0, 0, 3)]
    assert got == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_float_encodings_are_exact_round_to_nearest_even() -> None:
    v = np.concatenate(
        [synthetic.standard(5, 0, 20_000) * 37.0, [0.0, -0.0, 1e-9, -3e-5, 2.0**-20, 1.0]]
    )
    # numpy converts float64 to float16 with one correct rounding (torch goes via float32).
    assert synthetic.encode(v, "float16") == v.astype("<f2").tobytes()
    # Values exact in float32 round the same in torch's float32 conversions.
    v32 = v.astype(np.float32).astype(np.float64)
    for dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        fmt = synthetic._FLOATS[dtype][0]
        clipped = np.clip(v32, -fmt.max_finite, fmt.max_finite)
        want = torch.from_numpy(clipped.astype(np.float32)).to(getattr(torch, dtype))
        assert synthetic.encode(clipped, dtype) == want.view(torch.uint8).numpy().tobytes()


def test_values_follow_the_stats_and_stay_finite() -> None:
    vals = np.frombuffer(generate(Params(3, "float32", -100, 100, 2.0, 3.0), 4 * 200_000), "<f4")
    assert abs(vals.mean() - 2.0) < 0.05 and abs(vals.std() - 3.0) < 0.05
    assert vals.min() >= 2.0 - 3.0 * 2 * 3**0.5 - 1e-3  # Irwin-Hall of 4: bounded tails
    wide = generate(Params(3, "float8_e4m3fn", -1e30, 1e30, 0.0, 1e29), 50_000)
    assert not np.isin(wide, [0x7F, 0xFF]).any()  # clamped to ±448 before the cast: no NaN
    back = torch.from_numpy(wide.copy()).view(torch.float8_e4m3fn).float()
    assert torch.isfinite(back).all() and back.abs().max() == 448
    ints = np.frombuffer(generate(Params(1, "int8", -1e9, 1e9, 0.0, 1e6), 10_000), "i1")
    assert ints.min() == -128 and ints.max() == 127
    clamped = np.frombuffer(generate(Params(1, "float64", 0.0, 0.5, 0.0, 10.0), 8000), "<f8")
    assert clamped.min() >= 0.0 and clamped.max() <= 0.5


def test_seeds_give_different_streams() -> None:
    a = generate(Params(1, "float32", -9, 9, 0, 1), 4096).tobytes()
    b = generate(Params(2, "float32", -9, 9, 0, 1), 4096).tobytes()
    assert a != b


@pytest.mark.parametrize(
    ("name", "version", "seed", "dtype", "needle"),
    [
        ("mersenne", 1, 0, "float32", "unknown"),
        ("splitmix64-ih4", 2, 0, "float32", "version 2"),
        ("splitmix64-ih4", True, 0, "float32", "version"),
        ("splitmix64-ih4", 1, -1, "float32", "seed"),
        ("splitmix64-ih4", 1, 1 << 64, "float32", "seed"),
        ("splitmix64-ih4", 1, 1.5, "float32", "seed"),
        ("splitmix64-ih4", 1, 0, "complex64", "cannot produce"),
        ("splitmix64-ih4", 1, 0, "float4_e2m1fn_x2", "cannot produce"),
        (None, 1, 0, "float32", "unknown"),
    ],
)
def test_refusals(name: object, version: object, seed: object, dtype: str, needle: str) -> None:
    why = refusal(name, version, seed, dtype)
    assert why is not None and needle in why
    if isinstance(name, str) and isinstance(seed, int) and isinstance(version, int):
        with pytest.raises(ValueError, match=needle):
            generate(Params(seed, dtype, 0, 1, 0, 1, name, version), 8)
