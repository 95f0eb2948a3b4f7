"""strata.quant against a scalar reference written here, independently, in numpy (Note [Compressed
copies]): the compressed bytes equal the reference's byte for byte, the dequantized values equal
the reference's bit for bit on every SIMD variant, and every element is within half its group's
step (plus the roundings of fp32 and of the output dtype), for int8 and int4, float32, bfloat16
and float16 sources, and shapes whose rows do not divide into groups."""

import numpy as np
import pytest
import strata
import torch
from strata import quant

LEVELS = {"int8": 255, "int4": 15}
ISAS = [isa for isa in ("baseline", "avx2", "avx512f") if quant.supports(isa)]


def f16_floor(x: float) -> np.float16:
    """The largest float16 <= x."""
    h = np.float16(x)
    while float(h) > x:
        h = np.nextafter(h, np.float16(-np.inf))
    while float(np.nextafter(h, np.float16(np.inf))) <= x:
        h = np.nextafter(h, np.float16(np.inf))
    return h


def f16_ceil(x: float) -> np.float16:
    """The smallest float16 >= x (x >= 0)."""
    h = np.float16(x)
    while float(h) < x:
        h = np.nextafter(h, np.float16(np.inf))
    while h > 0 and float(np.nextafter(h, np.float16(-np.inf))) >= x:
        h = np.nextafter(h, np.float16(-np.inf))
    return h


def reference(values: np.ndarray, bits: str, group: int, f16_out: bool = False):
    """(packed bytes, codes, m, s) of `values` (float64, rows x cols), element by element;
    `f16_out`: the tensor is float16 (its values come back as float16)."""
    rows, cols = values.shape
    groups = -(-cols // group)
    code_bytes = cols if bits == "int8" else (cols + 1) // 2
    stride = (4 * groups + code_bytes + 3) // 4 * 4
    packed = np.zeros((rows, stride), dtype=np.uint8)
    codes = np.zeros((rows, cols), dtype=np.int64)
    m_all = np.zeros((rows, cols), dtype=np.float16)
    s_all = np.zeros((rows, cols), dtype=np.float16)
    for r in range(rows):
        for g in range(groups):
            seg = values[r, g * group : (g + 1) * group]
            m = f16_floor(float(seg.min()))
            s = f16_ceil((float(seg.max()) - float(m)) / LEVELS[bits])
            packed[r, 4 * g : 4 * g + 2] = np.frombuffer(m.tobytes(), np.uint8)
            packed[r, 4 * g + 2 : 4 * g + 4] = np.frombuffer(s.tobytes(), np.uint8)
            for i, x in enumerate(seg):
                c = g * group + i
                q = (
                    0
                    if s == 0
                    else int(min(max(np.rint((x - float(m)) / float(s)), 0), LEVELS[bits]))
                )
                while (
                    f16_out
                    and q > 0
                    and np.isinf(np.float16(np.float32(q) * np.float32(s) + np.float32(m)))
                ):
                    q -= 1  # a float16 tensor's value past 65504 takes the code below
                codes[r, c] = q
                m_all[r, c], s_all[r, c] = m, s
                if bits == "int8":
                    packed[r, 4 * groups + c] = q
                else:
                    packed[r, 4 * groups + c // 2] |= q << (4 * (c % 2))
    return packed.reshape(-1), codes, m_all, s_all


def source(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x[..., ::3] *= 1e-3  # small and large magnitudes side by side, and an offset
    x = x + torch.linspace(-4, 4, shape[-1], dtype=torch.float64)
    return x.to(dtype)


@pytest.mark.parametrize("bits", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape,group",
    [
        ((3, 5, 67), 64),
        ((130,), 64),
        ((2, 1), 64),
        ((4, 100), 32),
        ((3, 300), 256),
        # Rows longer than the dequantizer's chunk of 1024 (Note [Dequantizing a row in chunks]):
        # whole groups a chunk; chunks of 1000 (groups of 100) and a short last group; a group
        # longer than a chunk, split across two.
        ((2, 2500), 64),
        ((2, 2150), 100),
        ((2, 3001), 1500),
    ],
)
def test_quantize_and_dequantize_equal_the_reference(bits, dtype, shape, group):
    x = source(dtype, shape, seed=len(shape) * 1000 + shape[-1])
    values = x.to(torch.float64).numpy().reshape(-1, shape[-1])
    expected, codes, m, s = reference(values, bits, group, dtype == torch.float16)
    packed = quant.quantize(x, bits, group, name="w")
    assert packed.tobytes() == expected.tobytes()
    # Dequantization: float(q) * s + m in fp32 (no FMA), rounded to the dtype (nearest even).
    wide = codes.astype(np.float32) * s.astype(np.float32) + m.astype(np.float32)
    want = torch.from_numpy(wide).to(dtype).reshape(shape)
    for isa in ISAS:
        out = torch.empty(shape, dtype=dtype)
        quant.dequantize(packed, shape, bits, group, out=out, isa=isa)
        assert torch.equal(
            out.view(torch.int16 if dtype != torch.float32 else torch.int32),
            want.view(torch.int16 if dtype != torch.float32 else torch.int32),
        ), isa
    # The bound: half the group's step, plus fp32's two roundings and the output's half ulp.
    got = want.to(torch.float64).numpy().reshape(values.shape)
    step = s.astype(np.float64)
    ulp32 = np.spacing(np.abs(got).astype(np.float32) + np.abs(m).astype(np.float32)).astype(
        np.float64
    )
    out_ulp = {
        torch.float32: np.spacing(np.abs(got).astype(np.float32)).astype(np.float64),
        torch.float16: np.spacing(np.abs(got).astype(np.float16)).astype(np.float64),
        torch.bfloat16: np.abs(got) * 2.0**-7 + 2.0**-133,
    }[dtype]
    assert np.all(np.abs(got - values) <= step / 2 + 2 * ulp32 + out_ulp / 2)
    assert np.all(m.astype(np.float64) <= values)


def test_compressed_bytes_are_the_fractions_the_issue_names():
    # An fp32 weight of 4096 columns: int8 0.266 of its bytes, int4 0.141 (<= 0.3 and 0.17).
    full = 4 * 4096 * 4096
    assert quant.compressed_bytes((4096, 4096), "int8") / full == pytest.approx(0.265625)
    assert quant.compressed_bytes((4096, 4096), "int4") / full == pytest.approx(0.140625)


def test_bad_input_is_refused_naming_it():
    x = np.ones((2, 8), dtype=np.float32)
    x[1, 5] = np.inf
    with pytest.raises(
        strata.InvalidArgumentError, match="tensor 'blk.w': element 5 of row 1 is inf"
    ):
        quant.quantize(x, "int8", 4, name="blk.w")
    with pytest.raises(strata.InvalidArgumentError, match="even group size"):
        quant.quantize(np.ones(8, np.float32), "int4", 3)
    with pytest.raises(strata.InvalidArgumentError, match="tensor 'ids'.* must be float32"):
        quant.quantize(np.ones(8, np.int32), "int8", 4, name="ids")
    with pytest.raises(strata.InvalidArgumentError, match="not a compression"):
        quant.quantize(np.ones(8, np.float32), "int2", 4)
    packed = quant.quantize(np.ones(8, np.float32), "int8", 4)
    with pytest.raises(strata.InvalidArgumentError, match="the shape needs"):
        quant.dequantize(packed, (9,), "int8", 4)


def test_a_float16_group_at_the_limit_of_float16_comes_back_finite():
    x = torch.tensor([[-65504.0, 0.0, 1.0, 65504.0]], dtype=torch.float16)
    for bits in ("int8", "int4"):
        values = x.to(torch.float64).numpy()
        expected, _, _, s = reference(values, bits, 4, f16_out=True)
        packed = quant.quantize(x, bits, 4)
        assert packed.tobytes() == expected.tobytes()
        out = torch.empty_like(x)
        quant.dequantize(packed, tuple(x.shape), bits, 4, out=out)
        assert torch.isfinite(out).all(), out
        assert out[0, 3].item() >= 65504 - float(s[0, 3]), out
