"""kdump's synthetic-data generator: the bytes of a `synthetic` storage (docs/FORMAT.md §5.2).

The bytes are a pure function of (generator name, version, seed, statistics, size): integer
arithmetic on uint64 counters and correctly rounded float64 operations only (no transcendental
function, no torch or platform RNG), and every narrowing to a storage dtype is an exact integer
encoding written here. A slimmed bundle therefore expands to the same bytes on every machine and
every torch version. Torch-free; numpy is imported only to generate (the parser checks a
bundle's generator parameters with `refusal` alone).

Generator "splitmix64-ih4", version 1, element i (0-based, counted from the span's first byte):

1. w = splitmix64(seed + (i + 1) * 0x9E3779B97F4A7C15 mod 2^64);
2. the four 16-bit fields h_k of w give u_k = (h_k + 0.5) / 65536 and
   z = (u_0 + u_1 + u_2 + u_3 - 2) * 1.7320508075688772 (Irwin-Hall: mean 0, variance 1);
3. v = mean + std * z, clamped to [min, max] of the statistics, then to the dtype's finite range;
4. v is encoded in the dtype: integers round half to even; float32 and float64 by IEEE rounding;
   float16, bfloat16, float8_e4m3fn and float8_e5m2 round to nearest even by `_encode_float`;
   float8_e8m0fnu takes the exponent floor(log2 v) (v clamped to [2^-127, 2^127]); bool is
   v >= 0.5.

The storage's bytes are the little-endian encodings of elements 0, 1, ... cut to its size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_SQRT3 = 1.7320508075688772
_CHUNK = 1 << 20  # elements generated at once (bounded memory for any size)
SEED_LIMIT = 1 << 64


@dataclass(frozen=True)
class FloatFormat:
    """A binary float format: exponent bits, mantissa bits, bias, largest finite value."""

    exp_bits: int
    man_bits: int
    bias: int
    max_finite: float


_FLOATS: dict[str, tuple[FloatFormat, str, int]] = {
    "float16": (FloatFormat(5, 10, 15, 65504.0), "<u2", 2),
    "bfloat16": (FloatFormat(8, 7, 127, 3.3895313892515355e38), "<u2", 2),
    "float8_e4m3fn": (FloatFormat(4, 3, 7, 448.0), "u1", 1),
    "float8_e5m2": (FloatFormat(5, 2, 15, 57344.0), "u1", 1),
}
# Integer dtypes: the float64 range values are clamped to (the largest float64 that fits).
_INTS: dict[str, tuple[str, float, float, int]] = {
    "int8": ("<i1", -128.0, 127.0, 1),
    "int16": ("<i2", -32768.0, 32767.0, 2),
    "int32": ("<i4", -2147483648.0, 2147483647.0, 4),
    "int64": ("<i8", -9223372036854775808.0, 9223372036854774784.0, 8),
    "uint8": ("<u1", 0.0, 255.0, 1),
    "uint16": ("<u2", 0.0, 65535.0, 2),
    "uint32": ("<u4", 0.0, 4294967295.0, 4),
    "uint64": ("<u8", 0.0, 18446744073709549568.0, 8),
}
_OTHER = {"float32": ("<f4", 4), "float64": ("<f8", 8), "float8_e8m0fnu": ("u1", 1)}
_OTHER["bool"] = ("u1", 1)
_F32_MAX = 3.4028234663852886e38

# The one table of generators: name -> versions this kdump produces. A bundle naming any other
# is refused (BundleError), never guessed at.
GENERATORS: dict[str, tuple[int, ...]] = {"splitmix64-ih4": (1,)}
DEFAULT_GENERATOR = "splitmix64-ih4"
DEFAULT_VERSION = 1
# The dtypes version 1 can produce (complex, fnuz and fp4 encodings are not defined).
DTYPES: frozenset[str] = frozenset([*_FLOATS, *_INTS, *_OTHER])


def refusal(name: object, version: object, seed: object, dtype: object) -> str | None:
    """Why these generator parameters cannot be produced here (None: they can)."""
    if not isinstance(name, str) or name not in GENERATORS:
        return f"generator {str(name)[:40]!r} is unknown (this kdump knows {sorted(GENERATORS)})"
    if not _is_int(version) or version not in GENERATORS[name]:
        return f"generator {name} version {repr(version)[:20]} is unknown here; upgrade kdump-gpu"
    if not _is_int(seed) or not 0 <= seed < SEED_LIMIT:
        return f"generator seed {repr(seed)[:30]} is not an integer in [0, 2^64)"
    if dtype not in DTYPES:
        return f"generator {name} cannot produce dtype {str(dtype)[:40]!r}"
    return None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def itemsize(dtype: str) -> int:
    if dtype in _FLOATS:
        return _FLOATS[dtype][2]
    if dtype in _INTS:
        return _INTS[dtype][3]
    return _OTHER[dtype][1]


def splitmix64(seed: int, start: int, count: int) -> np.ndarray:
    """Words start .. start+count-1 of the splitmix64 sequence of `seed` (uint64)."""
    import numpy as np

    u = np.uint64
    with np.errstate(over="ignore"):
        i = np.arange(start + 1, start + count + 1, dtype=np.uint64)
        z = u(seed) + i * u(_GOLDEN)
        z = (z ^ (z >> u(30))) * u(_MUL1)
        z = (z ^ (z >> u(27))) * u(_MUL2)
        return z ^ (z >> u(31))


def standard(seed: int, start: int, count: int) -> np.ndarray:
    """Unit-variance values of elements start .. start+count-1 (float64, exact arithmetic)."""
    import numpy as np

    w = splitmix64(seed, start, count)
    mask = np.uint64(0xFFFF)
    total = np.zeros(count, dtype=np.float64)
    for k in range(4):
        total += ((w >> np.uint64(16 * k)) & mask).astype(np.float64)
    # Each u_k is (h_k + 0.5) / 65536; their sum minus 2, all exact in float64.
    return ((total + 2.0) / 65536.0 - 2.0) * _SQRT3


def _encode_float(v: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Round-to-nearest-even encoding of finite float64 values within the format's range."""
    import numpy as np

    sign = np.signbit(v).astype(np.uint64)
    a = np.abs(v)
    _, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1 (exact)
    unbiased = e.astype(np.int64) - 1
    biased = np.maximum(unbiased + fmt.bias, 1)  # subnormals share the smallest exponent
    q = np.rint(np.ldexp(a, -(biased - fmt.bias - fmt.man_bits)))  # exact scaling, RNE
    bits = ((biased - 1).astype(np.uint64) << np.uint64(fmt.man_bits)) + q.astype(np.uint64)
    bits = np.where(a == 0, np.uint64(0), bits)
    return bits | (sign << np.uint64(fmt.exp_bits + fmt.man_bits))


def encode(v: np.ndarray, dtype: str) -> bytes:
    """Little-endian bytes of float64 values `v` in `dtype` (clamped to its finite range)."""
    import numpy as np

    if dtype in _FLOATS:
        fmt, np_type, _ = _FLOATS[dtype]
        v = np.clip(v, -fmt.max_finite, fmt.max_finite)
        return _encode_float(v, fmt).astype(np_type).tobytes()
    if dtype in _INTS:
        np_type, lo, hi, _ = _INTS[dtype]
        return np.clip(np.rint(v), lo, hi).astype(np_type).tobytes()
    if dtype == "float32":
        return np.clip(v, -_F32_MAX, _F32_MAX).astype("<f4").tobytes()
    if dtype == "float64":
        return v.astype("<f8").tobytes()
    if dtype == "float8_e8m0fnu":
        _, e = np.frexp(np.clip(v, 2.0**-127, 2.0**127))
        return (e.astype(np.int64) - 1 + 127).astype("u1").tobytes()
    if dtype == "bool":
        return (v >= 0.5).astype("u1").tobytes()
    raise ValueError(f"dtype {dtype!r} is not produced by the generator")


@dataclass(frozen=True)
class Params:
    """What a synthetic storage names: generator, version, seed, and its value statistics."""

    seed: int
    dtype: str
    min: float
    max: float
    mean: float
    std: float
    name: str = DEFAULT_GENERATOR
    version: int = DEFAULT_VERSION


def generate(p: Params, nbytes: int) -> np.ndarray:
    """The storage's `nbytes` bytes (uint8), generated in bounded chunks."""
    import numpy as np

    why = refusal(p.name, p.version, p.seed, p.dtype)
    if why is not None:
        raise ValueError(why)
    size = itemsize(p.dtype)
    count = -(-nbytes // size)
    out = np.empty(count * size, dtype=np.uint8)
    lo, hi = min(p.min, p.max), max(p.min, p.max)
    for start in range(0, count, _CHUNK):
        n = min(_CHUNK, count - start)
        v = np.clip(p.mean + p.std * standard(p.seed, start, n), lo, hi)
        out[start * size : (start + n) * size] = np.frombuffer(encode(v, p.dtype), np.uint8)
    return out[:nbytes]
