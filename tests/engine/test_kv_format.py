"""How K/V rows are stored (pdserve/engine/kv_format.py): the float casts, fp8 with a scale per token
and KV head in the row, int8 Hadamard-rotated with a float16 scale and offset in the row, the pool's
bytes against the KV formula, and whether torch's CPU float8_e4m3fn conversion is correct (it decides
that fp8 ships)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.config import KV_DTYPE_TABLE, KV_DTYPES, kv_bytes_per_token
from pdserve.engine.kv_format import KV_FORMATS, TORCH_DTYPES, format_of, hadamard
from pdserve.engine.model import DecoderModel
from pdserve.engine.model_runner import allocate_kv_cache

QUANTIZED = ["int8", "fp8"]


def rows(seed: int = 0, shape: tuple[int, ...] = (7, 3, 64)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


# --- fp8: torch's e4m3 on CPU against a hand-computed one ---------------------------------------------

def e4m3_value(code: int) -> float:
    """float8_e4m3fn by its definition: 1 sign, 4 exponent (bias 7), 3 mantissa bits; subnormals at
    exponent 0; no infinities; S.1111.111 is NaN, so the largest finite is 1.75 x 2^8 = 448."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


FINITE = sorted({e4m3_value(c) for c in range(256) if not math.isnan(e4m3_value(c))})


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value, a tie to the one with an even mantissa (float64, by search)."""
    grid = torch.tensor(FINITE, dtype=torch.float64)
    hi = torch.searchsorted(grid, x.double()).clamp(1, len(FINITE) - 1)
    below, above = grid[hi - 1], grid[hi]
    d_below, d_above = x.double() - below, above - x.double()
    even_below = (below.to(torch.float8_e4m3fn).view(torch.uint8) & 1) == 0  # exact: below is on the grid
    return torch.where((d_below < d_above) | ((d_below == d_above) & even_below), below, above)


def test_torch_reads_every_e4m3_code_as_its_definition():
    got = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    for code in range(256):
        expected = e4m3_value(code)
        assert (math.isnan(got[code]) and math.isnan(expected)) or got[code] == expected, code


@pytest.mark.parametrize("n", [5, 1 << 20])  # a few values, and enough for torch's vectorised kernel
def test_torch_rounds_float32_to_the_nearest_e4m3_with_ties_to_even(n):
    g = torch.Generator().manual_seed(n)
    x = ((torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * 448).float()
    x[: min(n, 4)] = torch.tensor([0.0, -0.0, 448.0, -448.0])[: min(n, 4)]
    assert torch.equal(x.to(torch.float8_e4m3fn).double(), nearest_e4m3(x))


def test_torch_rounds_every_midpoint_between_e4m3_values_to_even():
    grid = torch.tensor(FINITE, dtype=torch.float64)
    midpoints = ((grid[1:] + grid[:-1]) / 2).float()
    assert torch.equal(midpoints.double(), (grid[1:] + grid[:-1]) / 2)  # each one exact in float32
    assert torch.equal(midpoints.to(torch.float8_e4m3fn).double(), nearest_e4m3(midpoints))
    many = midpoints.repeat(4096)  # long enough for the vectorised kernel
    assert torch.equal(many.to(torch.float8_e4m3fn).double(), nearest_e4m3(many))


# --- the formats --------------------------------------------------------------------------------------

def test_formats_name_the_dtypes_of_the_config_table_and_their_bytes():
    assert tuple(KV_FORMATS) == KV_DTYPES
    for name, fmt in KV_FORMATS.items():
        spec = KV_DTYPE_TABLE[name]
        assert fmt.storage_dtype.itemsize == spec.element_bytes, name
        assert fmt.scale_elements * fmt.storage_dtype.itemsize == spec.scale_bytes, name
        assert format_of(TORCH_DTYPES[name]) is fmt
    with pytest.raises(ValueError, match="a KV pool of torch.float64 has no format"):
        format_of(torch.float64)


def test_a_float32_cache_stores_and_reads_k_itself():
    """No copy and no rounding: the float32 path is what it was before quantized caches existed."""
    x = rows()
    fmt = KV_FORMATS["float32"]
    assert fmt.store(x) is x and fmt.load(x) is x and fmt.round_trip(x) is x


def test_an_fp8_row_is_its_codes_then_its_float32_scale():
    fmt = KV_FORMATS["fp8"]
    x = rows()
    stored = fmt.store(x)
    assert stored.dtype == fmt.storage_dtype and stored.shape == (7, 3, 64 + 4)
    scale = stored.view(torch.uint8)[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / fmt.code_max)
    codes = stored.view(torch.uint8)[..., :64].contiguous().view(fmt.storage_dtype).float()
    assert codes.abs().amax(-1).eq(fmt.code_max).all()  # each row's largest value takes the largest code
    assert torch.equal(fmt.load(stored), codes * scale)


# --- int8: Hadamard-rotated, asymmetric codes, float16 scale and offset ---------------------------------

def test_the_rotation_is_orthogonal_symmetric_and_blockwise_for_other_head_dims():
    h = hadamard(64)
    assert torch.equal(h.abs(), torch.full((64, 64), 1 / 8))  # every entry +-1/8: spreads each channel
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6)
    h96 = hadamard(96)  # not a power of two: three 32 x 32 blocks on the diagonal
    assert torch.equal(h96[:32, :32], hadamard(32)) and torch.equal(h96[:32, 32:], torch.zeros(32, 64))
    assert torch.allclose(h96 @ h96, torch.eye(96), atol=1e-6)


def test_an_int8_row_known_answer():
    """Rotated values on a grid of 2^-7 from -0.5 to 1.4921875 (codes -128..127 at offset 0.5):
    every product is exact in float32, so the row is known to the byte and reads back exactly."""
    codes = torch.cat((torch.tensor([-128, 127]), torch.arange(-124, 124, 4)))
    y = codes.float() / 128 + 0.5
    x = y @ hadamard(64)  # y = x H, H its own inverse
    stored = KV_FORMATS["int8"].store(x)
    assert stored.shape == (68,) and stored.dtype == torch.int8
    assert torch.equal(stored[:64], codes.to(torch.int8))
    assert stored.view(torch.uint8)[64:].tolist() == [0x00, 0x20, 0x00, 0x38]  # float16 2^-7, then 0.5
    assert torch.equal(KV_FORMATS["int8"].load_rotated(stored), y)
    assert torch.equal(KV_FORMATS["int8"].load(stored), x)


def test_int8_rounds_each_rotated_value_to_within_half_a_step():
    fmt = KV_FORMATS["int8"]
    x = rows(1)
    x[..., 55] += 40  # a large channel, as SmolLM2's keys have
    y = fmt.rotate(x)
    affine = fmt.store(x).view(torch.uint8)[..., 64:].contiguous().view(torch.float16).float()
    scale, offset = affine[..., :1], affine[..., 1:]
    assert (scale * 255 >= y.amax(-1, keepdim=True) - y.amin(-1, keepdim=True)).all()
    slack = offset.abs() * 2.0 ** -11  # the offset's float16 rounding, at a clamped end code
    assert ((fmt.load_rotated(fmt.store(x)) - y).abs() <= 0.5 * scale * (1 + 1e-5) + slack).all()
    assert ((fmt.round_trip(x) - x).pow(2).mean(-1) <= (scale / 2).pow(2).squeeze(-1)).all()


def test_int8_rows_are_stateless_functions_of_each_row():
    """What keeps every cache path exact: a row's bytes depend on that row alone."""
    fmt = KV_FORMATS["int8"]
    x = rows(5, (9, 3, 64))
    together = fmt.store(x)
    assert torch.equal(fmt.store(x.flip(0)), together.flip(0))
    for i in range(9):
        assert torch.equal(fmt.store(x[i : i + 1]), together[i : i + 1])
    assert torch.equal(fmt.store(x), together)  # and again: nothing was kept


def test_attention_in_the_rows_basis_equals_attention_over_the_values():
    """The model's shortcut (kv_format docstring): rotate q, attend over load_rotated, rotate back."""
    fmt = KV_FORMATS["int8"]
    q = rows(6, (1, 4, 10, 64)) / 8
    k, v = fmt.store(rows(7, (1, 4, 12, 64))), fmt.store(rows(8, (1, 4, 12, 64)))
    direct = F.scaled_dot_product_attention(q, fmt.load(k), fmt.load(v))
    in_basis = F.scaled_dot_product_attention(fmt.rotate(q), fmt.load_rotated(k), fmt.load_rotated(v))
    assert torch.allclose(fmt.unrotate(in_basis), direct, atol=1e-5)


def test_int8_is_closer_than_the_unrotated_symmetric_encoding_on_rows_with_a_large_channel():
    """Why int8 rotates (docs/benchmarks.md, KV cache dtypes): half the error or less on such rows."""
    x = rows(9, (64, 3, 64))
    x[..., 55] += 40
    scale = x.abs().amax(-1, keepdim=True) / 127
    unrotated = (x / scale).round() * scale
    ours = KV_FORMATS["int8"].round_trip(x)
    assert (ours - x).pow(2).mean() * 4 <= (unrotated - x).pow(2).mean()


def test_fp8_rounds_each_scaled_value_to_the_nearest_e4m3():
    fmt = KV_FORMATS["fp8"]
    x = rows(2)
    scale = x.abs().amax(-1, keepdim=True) / 448
    codes = fmt.store(x).view(torch.uint8)[..., :64].contiguous().view(torch.float8_e4m3fn).double()
    assert torch.equal(codes, nearest_e4m3((x / scale).clamp(-448, 448)))


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_a_row_of_zeros_stays_zero_and_reads_back_finite(kv_dtype):
    fmt = KV_FORMATS[kv_dtype]
    x = rows(3)
    x[2, 1] = 0
    back = fmt.round_trip(x)
    assert torch.isfinite(back).all() and torch.equal(back[2, 1], torch.zeros(64))
    fresh_pool_rows = torch.zeros(4, 68, dtype=fmt.storage_dtype)
    assert torch.equal(fmt.load(fresh_pool_rows), torch.zeros(4, 64))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_load_reads_strided_views_as_the_model_gathers_them(kv_dtype):
    """The decode path reads a transposed view of the gathered rows, with head_dims not a multiple of 4.

    Reading the stored bytes (load_rotated: codes, scale and offset out of a strided row) is elementwise
    and must give the same bits. int8's load then rotates back with a float32 product, whose sums torch
    may order by the operand's layout (a transposed [3, 5, 6] operand gave other last bits than the
    contiguous one on 2026-12-05's AVX-512 Xeon, not on an AVX2 CPU): that step gets float32 rounding."""
    fmt = KV_FORMATS[kv_dtype]
    for head_dim in (64, 6):
        stored = fmt.store(rows(4, (5, 3, head_dim)))
        strided, contiguous = stored.transpose(0, 1), stored.transpose(0, 1).contiguous()
        assert not strided.is_contiguous()
        assert torch.equal(fmt.load_rotated(strided), fmt.load_rotated(contiguous))
        torch.testing.assert_close(fmt.load(strided), fmt.load(contiguous), rtol=1e-6, atol=1e-6)


# --- the pool -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_pool_holds_exactly_the_bytes_the_kv_formula_counts(tiny_loaded, kv_dtype):
    c = tiny_loaded.config
    model = DecoderModel(c, tiny_loaded.state_dict, torch.device("cpu"))
    pool = allocate_kv_cache(model, num_blocks=5, block_size=16, kv_dtype=kv_dtype)
    assert pool.dtype == TORCH_DTYPES[kv_dtype]
    # the 5 blocks and the null block that a static decode step's padded rows write (model_runner.py)
    assert pool.numel() * pool.element_size() == (5 + 1) * 16 * kv_bytes_per_token(
        c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
