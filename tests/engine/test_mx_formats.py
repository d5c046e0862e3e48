"""OCP MX v1.0 formats (engine/quant/mx.py) against the spec's tables, a float64 brute-force
reference, and torchao 0.18's `to_mx` / `to_dtype` as an independent bit-level oracle.

Known, intended differences from torchao (see the mx.py docstring):
  * scale byte 0 with non-zero elements: torchao divides by 2^-126 instead of 2^-127, so its codes
    there equal ours for 2x; `test_denormal_blocks` checks exactly that relation.
  * element codes inside a NaN-scale block are don't-care (the block decodes to NaN); only the
    finite elements' +-0 codes are compared there.
Signed zero: we write torchao's bits (-0 and negatives that round to zero keep the sign, 0x8 for
fp4); Quark writes +0 (0x0). `test_quark_zero_convention` compares after mapping.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from engine.quant.mx import (
    MX_FORMATS,
    MXFP4,
    MXFP6_E2M3,
    MXFP6_E3M2,
    MXFP8,
    MXFormat,
    MXTensor,
    code_values,
    decode_codes,
    dequantize_mx,
    e8m0_to_float,
    get_mx_format,
    pack_fp4,
    pack_fp6,
    quantize_mx,
    unpack_codes,
    unpack_fp4,
    unpack_fp6,
)

FORMATS = list(MX_FORMATS)
MODES = ["even", "floor"]
FP32_MAX = torch.finfo(torch.float32).max


# ---------------------------------------------------------------------------------------------
# helpers


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor (so -0 != +0 and NaN == NaN of the same payload)."""
    int_dtypes = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(int_dtypes[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    diff = bits_of(a) != bits_of(b)
    assert not diff.any(), f"{int(diff.sum())} differ; first at {diff.nonzero()[:4].tolist()}"


def block_view(t: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], t.shape[-1] // block_size, block_size)


def f32_below(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(-math.inf)).item()


def f32_above(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(math.inf)).item()


def make_blocks(num_rows: int, num_blocks: int, log2_lo: int, log2_hi: int, dtype, seed: int = 0):
    """Gaussian blocks, each scaled by its own 2^U[log2_lo, log2_hi): [rows, 32 * num_blocks]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, num_blocks, 32, generator=g, dtype=torch.float64)
    log2_scale = torch.randint(log2_lo, log2_hi, (num_rows, num_blocks, 1), generator=g)
    x = x * torch.exp2(log2_scale.double())
    return x.reshape(num_rows, -1).to(dtype)


def reference_scales(x: torch.Tensor, fmt: MXFormat, mode: str, block_size: int = 32):
    """Float64 restatement of OCP MX v1.0 section 6.3 for finite x (torchao and mx.py use bits)."""
    amax = block_view(x.double(), block_size).abs().amax(-1)
    mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
    if mode == "even":  # round amax to mbits mantissa bits, half to even
        step = 2.0 ** (fmt.mbits + 1)
        mant = torch.round(mant * step) / step
    floor_log2 = torch.floor(torch.log2(mant)) + exp
    shared = torch.where(amax == 0, -127.0, floor_log2 - fmt.emax).clamp(-127, 127)
    return (shared + 127).to(torch.uint8)


def reference_codes(x: torch.Tensor, scales: torch.Tensor, fmt: MXFormat, block_size: int = 32):
    """Brute-force RNE: the nearest finite code to x / X, ties to the even code, saturating."""
    X = torch.exp2(scales.double() - 127).unsqueeze(-1)
    y = (block_view(x.double(), block_size) / X).reshape(-1)
    positive = code_values(fmt).double()[: fmt.sign_mask]
    positive = positive[~torch.isnan(positive)]  # E4M3: drop the NaN code 0x7F
    dist = (y.abs().clamp(max=fmt.max_normal)[:, None] - positive[None, :]).abs()
    nearest = dist == dist.min(-1, keepdim=True).values  # one code, or two on a tie
    even = torch.arange(positive.numel()) % 2 == 0
    code = (nearest * (1 + even)).argmax(-1)  # the even one of a tied pair
    code = code | (torch.signbit(y).long() << (fmt.bits - 1))
    return code.to(torch.uint8).reshape(x.shape)


class TorchaoOracle:
    """torchao 0.18's emulated MX cast (pure torch, runs on CPU)."""

    def __init__(self) -> None:
        from torchao.prototype.mx_formats import mx_tensor
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2

        self.mx_tensor = mx_tensor
        self.modes = {"even": ScaleCalculationMode.EVEN, "floor": ScaleCalculationMode.FLOOR}
        self.elem_dtypes = {
            "mxfp4": torch.float4_e2m1fn_x2,
            "mxfp6_e2m3": DTYPE_FP6_E2M3,
            "mxfp6_e3m2": DTYPE_FP6_E3M2,
            "mxfp8": torch.float8_e4m3fn,
        }
        self.unavailable: dict[str, str] = {}
        for name, elem in self.elem_dtypes.items():
            try:
                mx_tensor.to_mx(torch.ones(1, 32), elem, 32, self.modes["floor"])
            except Exception as exc:  # report why in the skip, e.g. a CUDA-only fp6 kernel
                self.unavailable[name] = f"torchao to_mx({elem}) fails on CPU: {exc!r}"

    def require(self, fmt: MXFormat) -> None:
        if fmt.name in self.unavailable:
            pytest.skip(self.unavailable[fmt.name])

    def quantize(self, x, fmt: MXFormat, mode: str, block_size: int = 32):
        """-> (scales uint8 [..., K/bs], codes uint8 [..., K], one code per element)."""
        self.require(fmt)
        elem = self.elem_dtypes[fmt.name]
        scale, data = self.mx_tensor.to_mx(x.contiguous(), elem, block_size, self.modes[mode])
        codes = data.view(torch.uint8)
        if fmt.bits == 4:
            codes = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2)  # low nibble first
        return scale.view(torch.uint8), codes

    def dequantize(self, mx: MXTensor, dtype: torch.dtype) -> torch.Tensor:
        data = {4: mx.codes, 6: unpack_codes(mx), 8: mx.codes.view(torch.float8_e4m3fn)}
        scale = mx.scales.view(torch.float8_e8m0fnu)
        elem = self.elem_dtypes[mx.fmt.name]
        return self.mx_tensor.to_dtype(data[mx.fmt.bits], scale, elem, mx.block_size, dtype)


@pytest.fixture(scope="module")
def ao() -> TorchaoOracle:
    pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao is the oracle")
    logging.getLogger("torchao").setLevel(logging.ERROR)
    return TorchaoOracle()


def assert_matches_torchao(ao: TorchaoOracle, x, fmt: MXFormat, mode: str, block_size: int = 32):
    """Scales and every code bit-identical; dequantization bit-identical to torchao's to_dtype."""
    ours = quantize_mx(x, fmt, mode, block_size)
    scales, codes = ao.quantize(x, fmt, mode, block_size)
    assert_same_bits(ours.scales, scales)
    assert_same_bits(unpack_codes(ours), codes)
    for dtype in (torch.float32, torch.bfloat16):
        assert_same_bits(dequantize_mx(ours, dtype), ao.dequantize(ours, dtype))
    return ours


# ---------------------------------------------------------------------------------------------
# spec tables, hand-checked


def test_format_table():
    assert [MX_FORMATS[n] for n in ("mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8")] == [
        MXFP4,
        MXFP6_E2M3,
        MXFP6_E3M2,
        MXFP8,
    ]
    expected = {  # name: (bits, ebits, mbits, emax, max normal, bias)
        "mxfp4": (4, 2, 1, 2, 6.0, 1),
        "mxfp6_e2m3": (6, 2, 3, 2, 7.5, 1),
        "mxfp6_e3m2": (6, 3, 2, 4, 28.0, 3),
        "mxfp8": (8, 4, 3, 8, 448.0, 7),
    }
    for name, (bits, ebits, mbits, emax, max_normal, bias) in expected.items():
        f = get_mx_format(name)
        got = (f.bits, f.ebits, f.mbits, f.emax, f.max_normal, f.bias)
        assert got == (bits, ebits, mbits, emax, max_normal, bias)
        table = code_values(f)
        assert table.numel() == 2**bits
        assert table[~torch.isnan(table)].max().item() == max_normal
        assert math.floor(math.log2(max_normal)) == emax
    assert get_mx_format(MXFP8) is MXFP8
    with pytest.raises(ValueError, match="unknown MX format"):
        get_mx_format("mxfp5")


def test_code_values_match_spec_tables():
    fp4 = code_values(MXFP4)
    assert fp4[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert fp4[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(fp4[8])  # 0x8 is -0

    e2m3 = code_values(MXFP6_E2M3)  # bias 1, subnormals k/8
    codes = [0x01, 0x07, 0x08, 0x09, 0x1F, 0x3F]
    assert e2m3[codes].tolist() == [0.125, 0.875, 1.0, 1.125, 7.5, -7.5]
    e3m2 = code_values(MXFP6_E3M2)  # bias 3, subnormals k/16
    codes = [0x01, 0x03, 0x04, 0x05, 0x1E, 0x1F, 0x3F]
    assert e3m2[codes].tolist() == [0.0625, 0.1875, 0.25, 0.3125, 24, 28, -28]

    e4m3 = code_values(MXFP8)
    assert e4m3[[0x01, 0x08, 0x7E, 0xFE]].tolist() == [2.0**-9, 2.0**-6, 448, -448]
    assert torch.isnan(e4m3[[0x7F, 0xFF]]).all()
    # the 256-entry table is torch's own float8_e4m3fn decoding (NaN payloads aside)
    torch_e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.isnan(e4m3), torch.isnan(torch_e4m3))
    finite = ~torch.isnan(e4m3)
    assert_same_bits(e4m3[finite], torch_e4m3[finite])

    # decode_codes is the LUT, any shape and dtype
    codes = torch.tensor([[0x7, 0xF], [0x2, 0x9]], dtype=torch.uint8)
    assert decode_codes(codes, "mxfp4", torch.bfloat16).tolist() == [[6, -6], [1, -0.5]]


def test_e8m0_decoding():
    s = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = e8m0_to_float(s)
    assert v[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(v[6])


def test_pack_fp4_layout():
    codes = torch.tensor([0x1, 0x2, 0x3, 0x4, 0xF, 0x8], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [0x21, 0x43, 0x8F]  # element 2i low nibble, 2i+1 high
    assert_same_bits(unpack_fp4(packed), codes)
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    assert pack_fp4(codes).shape == (3, 5, 32)
    assert_same_bits(unpack_fp4(pack_fp4(codes)), codes)
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_pack_fp6_layout():
    # 24-bit little-endian word v0 | v1<<6 | v2<<12 | v3<<18 (amd-quark Pack_fp6):
    # 0x01 | 0x02<<6 | 0x03<<12 | 0x3F<<18 = 0xFC3081 -> bytes 0x81, 0x30, 0xFC
    codes = torch.tensor([0x01, 0x02, 0x03, 0x3F, 0x3F, 0x00, 0x00, 0x00], dtype=torch.uint8)
    packed = pack_fp6(codes)
    assert packed.tolist() == [0x81, 0x30, 0xFC, 0x3F, 0x00, 0x00]
    assert_same_bits(unpack_fp6(packed), codes)
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 64, (2, 3, 64), generator=g, dtype=torch.uint8)
    assert pack_fp6(codes).shape == (2, 3, 48)
    assert_same_bits(unpack_fp6(pack_fp6(codes)), codes)
    with pytest.raises(ValueError, match="divisible by 4"):
        pack_fp6(torch.zeros(6, dtype=torch.uint8))


def test_fp4_class_table_matches_direct_rounding():
    """The 8192-entry class encoder equals RNE by bucketize on every class edge and random bits."""
    from engine.quant.mx import _encode_by_bucketize, _encode_elements

    top = torch.arange(4096, dtype=torch.int64) << 20
    low = torch.tensor([0, 1, 0x7FFFF, 0x80000, 0x80001, 0xFFFFF])
    g = torch.Generator().manual_seed(4)
    rand = torch.randint(-(2**31), 2**31, (1 << 16,), generator=g)
    bits = torch.cat([(top[:, None] | low[None, :]).reshape(-1), rand]).to(torch.int32)
    y = bits.view(torch.float32)
    y = y[torch.isfinite(y)]
    assert_same_bits(_encode_elements(y.clone(), MXFP4), _encode_by_bucketize(y, MXFP4))


def _one_block(values: list[float], dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values + [0.0] * (32 - len(values)), dtype=dtype)


def test_fp4_rounding_hand_vector():
    # amax 6 -> shared exponent floor(log2 6) - 2 = 0 -> byte 127 in both modes (6 = 1.5 * 2^2).
    # Midpoints round half to even: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    x = _one_block([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.25, -0.0, 0.26, 4.9, 5.1, -6, 3])
    expected = [0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xE, 0x8, 0x8, 0x1, 0x6, 0x7, 0xF, 0x5]
    for mode in MODES:
        mx = quantize_mx(x, "mxfp4", mode)
        assert mx.scales.tolist() == [127]
        assert unpack_codes(mx)[:16].tolist() == expected
        assert mx.codes.shape == (16,) and mx.codes[0].item() == (0x0 << 4) | 0x7


def test_fp6_rounding_hand_vectors():
    # E2M3, amax 7.5 = 1.875 * 2^2 -> byte 127 (its mantissa .875 is below EVEN's tie at .9375).
    # 0.0625 ties 0 / 0.125 -> 0; 0.1875 ties 0.125 (0x01) / 0.25 (0x02) -> 0x02;
    # 1.0625 ties 1.0 (0x08) / 1.125 (0x09) -> 0x08; 1.1875 ties 0x09 / 1.25 (0x0A) -> 0x0A.
    x = _one_block([7.5, 0.125, 0.0625, 0.1875, 1.0625, 1.1875, -7.5, -0.0, 7.25, 3.0])
    expected = [0x1F, 0x01, 0x00, 0x02, 0x08, 0x0A, 0x3F, 0x20, 0x1E, 0x14]
    for mode in MODES:
        mx = quantize_mx(x, "mxfp6_e2m3", mode)
        assert mx.scales.tolist() == [127]
        assert unpack_codes(mx)[:10].tolist() == expected
        assert mx.codes.shape == (24,)

    # E3M2, amax 28 = 1.75 * 2^4 -> byte 127. 0.03125 ties 0 / 0.0625 -> 0; 0.09375 ties
    # 0.0625 (0x01) / 0.125 (0x02) -> 0x02; 26 ties 24 (0x1E) / 28 (0x1F) -> 0x1E; 0.25 -> 0x04.
    x = _one_block([28, 0.0625, 0.03125, 0.09375, 26, 0.25, -28, -0.01, 20, 0.3125])
    expected = [0x1F, 0x01, 0x00, 0x02, 0x1E, 0x04, 0x3F, 0x20, 0x1D, 0x05]
    for mode in MODES:
        mx = quantize_mx(x, "mxfp6_e3m2", mode)
        assert mx.scales.tolist() == [127]
        assert unpack_codes(mx)[:10].tolist() == expected


@pytest.mark.parametrize(
    "fmt, amax, floor_byte, even_byte",
    [
        # FP4 (mbits 1, emax 2): EVEN moves up from mantissa 1.75 (rounds to 2.0).
        (MXFP4, 1.75, 125, 126),
        (MXFP4, f32_below(1.75), 125, 125),
        (MXFP4, 6.0, 127, 127),
        (MXFP4, 7.0, 127, 128),  # floor saturates 7 -> 6; even avoids it
        (MXFP4, 8.0, 128, 128),
        # E2M3 (mbits 3, emax 2) and E4M3 (mbits 3, emax 8): tie at 1.9375
        (MXFP6_E2M3, 1.9375, 125, 126),
        (MXFP6_E2M3, f32_below(1.9375), 125, 125),
        (MXFP8, 448.0, 127, 127),
        (MXFP8, 1.9375 * 2**8, 127, 128),
        # E3M2 (mbits 2, emax 4): tie at 1.875
        (MXFP6_E3M2, 1.875, 123, 124),
        (MXFP6_E3M2, 28.0, 127, 127),
        # E8M0 range: clamp at the bottom, and FLT_MAX whose rounding carries into exponent 255
        (MXFP4, 2.0**-140, 0, 0),
        (MXFP4, FP32_MAX, 252, 253),
        (MXFP8, FP32_MAX, 246, 247),
    ],
)
def test_scale_rules_hand(fmt, amax, floor_byte, even_byte):
    x = _one_block([amax, -amax / 3])
    assert quantize_mx(x, fmt, "floor").scales.tolist() == [floor_byte]
    assert quantize_mx(x, fmt, "even").scales.tolist() == [even_byte]
    if amax < FP32_MAX:  # float64 restatement agrees (it cannot see the FLT_MAX carry)
        assert reference_scales(x, fmt, "floor").tolist() == [floor_byte]
        assert reference_scales(x, fmt, "even").tolist() == [even_byte]


def test_all_zero_block_has_scale_zero():
    x = torch.zeros(2, 64)
    x[1, 32:] = -0.0
    for name in FORMATS:
        mx = quantize_mx(x, name)
        assert mx.scales.tolist() == [[0, 0], [0, 0]]
        y = dequantize_mx(mx, torch.float32)
        assert_same_bits(y, x)  # -0 stays -0 (torchao's convention)


# ---------------------------------------------------------------------------------------------
# against the float64 reference and torchao


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_random_matches_reference(name, mode, dtype):
    fmt = get_mx_format(name)
    x = make_blocks(8, 16, -40, 40, dtype, seed=3)
    mx = quantize_mx(x, fmt, mode)
    assert_same_bits(mx.scales, reference_scales(x, fmt, mode))
    assert_same_bits(unpack_codes(mx), reference_codes(x, mx.scales, fmt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_random_matches_torchao(ao, name, mode, dtype):
    fmt = get_mx_format(name)
    for i, (lo, hi) in enumerate([(-12, -8), (-2, 2), (8, 12), (-60, 60)]):
        x = make_blocks(16, 8, lo, hi, dtype, seed=10 + i)
        assert_matches_torchao(ao, x, fmt, mode)
    # leading dims and a non-default block size
    x = make_blocks(6, 8, -3, 3, dtype, seed=20).reshape(2, 3, 256)
    assert_matches_torchao(ao, x, fmt, mode)
    assert_matches_torchao(ao, make_blocks(4, 8, -3, 3, dtype, seed=21), fmt, mode, block_size=64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_ties_match_torchao(ao, name, mode):
    """Every rounding midpoint (and its float32 neighbours) at several block scales."""
    fmt = get_mx_format(name)
    pos = code_values(fmt).double()[: fmt.sign_mask]
    pos = pos[~torch.isnan(pos)]
    mids = (pos[1:] + pos[:-1]) / 2
    if mode == "floor":  # the saturation tie max + ulp/2 (even mode moves such a block's scale)
        mids = torch.cat([mids, (pos[-1] + (pos[-1] - pos[-2]) / 2).reshape(1)])
    below = torch.nextafter(mids.float(), torch.tensor(0.0)).double()
    above = torch.nextafter(mids.float(), torch.tensor(1e9)).double()
    vals = torch.cat([mids, below, above])
    vals = torch.cat([vals, -vals])
    num_blocks = math.ceil(vals.numel() / 31)
    body = torch.nn.functional.pad(vals, (0, num_blocks * 31 - vals.numel()))
    body = body.reshape(num_blocks, 31)
    # first element pins the block max to max_normal: scale 2^0 in both modes
    block = torch.cat([torch.full((num_blocks, 1), fmt.max_normal, dtype=torch.float64), body], 1)
    for k in (-20, 0, 3, 30):
        x = (block * 2.0**k).reshape(1, -1).float()
        mx = assert_matches_torchao(ao, x, fmt, mode)
        assert (mx.scales.int() == 127 + k).all()
        assert_same_bits(unpack_codes(mx), reference_codes(x, mx.scales, fmt))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_amax_rounding_ties_match_torchao(ao, name, mode):
    """Blocks whose amax sits on, just below and just above EVEN's exponent-rounding tie."""
    fmt = get_mx_format(name)
    tie = 2 - 2.0 ** -(fmt.mbits + 1)
    amaxes = [tie, f32_below(tie), f32_above(tie), 1.0, f32_below(2.0), 2.0]
    rows = []
    for e in (-100, -3, 0, 5, 100):
        for a in amaxes:
            body = torch.linspace(-a, a, 31, dtype=torch.float64) * 0.999
            rows.append(torch.cat([torch.tensor([a * 2.0**e]), body * 2.0**e]))
    x = torch.stack(rows).reshape(1, -1).float()
    for dtype in (torch.float32, torch.bfloat16):
        assert_matches_torchao(ao, x.to(dtype), fmt, mode)


@pytest.mark.parametrize("name", FORMATS)
def test_zero_blocks_match_torchao(ao, name):
    fmt = get_mx_format(name)
    x = make_blocks(4, 6, -2, 2, torch.float32, seed=5)
    x[0, :32] = 0.0
    x[1, 32:64] = -0.0
    x[2, 64:96] = torch.where(torch.arange(32) % 2 == 0, 0.0, -0.0)
    x[3, :] = torch.where(torch.arange(192) % 3 == 0, 0.0, x[3])  # zeros inside live blocks
    for mode in MODES:
        for dtype in (torch.float32, torch.bfloat16):
            mx = assert_matches_torchao(ao, x.to(dtype), fmt, mode)
            assert mx.scales[0, 0] == mx.scales[1, 1] == mx.scales[2, 2] == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_denormal_blocks(ao, name, mode):
    """amax in the float32/bf16 subnormal range and just above it.

    Blocks with scale byte >= 1 match torchao exactly. Byte-0 blocks with non-zero elements are
    divided by 2^-127 here (what the byte decodes to) and by 2^-126 in torchao, so their codes
    equal torchao's codes for 2x (2x stays at byte <= 1, where torchao also uses 2^-126).
    """
    fmt = get_mx_format(name)
    for dtype, lo in ((torch.float32, -148), (torch.bfloat16, -132)):
        x = make_blocks(16, 8, lo, -100, dtype, seed=7)
        ours = quantize_mx(x, fmt, mode)
        scales, codes = ao.quantize(x, fmt, mode)
        assert_same_bits(ours.scales, scales)
        assert_same_bits(ours.scales, reference_scales(x, fmt, mode))
        our_codes = block_view(unpack_codes(ours))
        quirk = (scales == 0) & (block_view(x) != 0).any(-1)  # [rows, blocks]
        assert quirk.any() and (~quirk).any()  # both kinds are exercised
        assert_same_bits(our_codes[~quirk], block_view(codes)[~quirk])

        doubled_scales, doubled_codes = ao.quantize(x * 2, fmt, mode)
        assert (doubled_scales[quirk] <= 1).all()
        assert_same_bits(our_codes[quirk], block_view(doubled_codes)[quirk])
        # and ours is the spec's RNE of x / 2^-127
        assert_same_bits(unpack_codes(ours), reference_codes(x, ours.scales, fmt))


@pytest.mark.parametrize("name", FORMATS)
def test_huge_values_match_torchao(ao, name):
    fmt = get_mx_format(name)
    big = [FP32_MAX, -FP32_MAX, 2.0**127, 1.75 * 2**127, 1.9375 * 2**127, 1.5 * 2**127, 1e38]
    x = make_blocks(len(big), 2, -2, 2, torch.float32, seed=8)
    for i, b in enumerate(big):
        x[i, 0] = b
        x[i, 33] = -b / 7
        x[i, 40:48] *= 1e37
    for mode in MODES:
        assert_matches_torchao(ao, x, fmt, mode)
        assert_matches_torchao(ao, x.to(torch.bfloat16), fmt, mode)


@pytest.mark.parametrize("name", FORMATS)
def test_nan_inf_blocks(ao, name):
    """NaN anywhere -> scale 0xFF and the block decodes to NaN (spec); Inf -> largest magnitude.

    torchao agrees on every scale, on all codes of non-NaN blocks (Inf saturates to +-max) and
    on the +-0 codes of finite elements in NaN blocks; the codes of NaN/Inf elements inside a NaN
    block are don't-care and not compared.
    """
    fmt = get_mx_format(name)
    nan, inf = float("nan"), float("inf")
    x = make_blocks(1, 6, -1, 1, torch.float32, seed=9).reshape(6, 32)
    x[0, 3] = nan
    x[1, 4] = inf
    x[2, 5] = -inf
    x[3, 0], x[3, 31] = nan, inf
    x[4, 7] = -nan
    x = x.reshape(1, -1)
    for mode in MODES:
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            ours = quantize_mx(xd, fmt, mode)
            scales, codes = ao.quantize(xd, fmt, mode)
            assert_same_bits(ours.scales, scales)
            assert ours.scales[0].tolist()[:5] == [255, 255 - fmt.emax, 255 - fmt.emax, 255, 255]
            our_codes = unpack_codes(ours)
            comparable = torch.isfinite(xd) | (ours.scales != 255).repeat_interleave(32, -1)
            assert_same_bits(our_codes[comparable], codes[comparable])

            y = block_view(dequantize_mx(ours, torch.float32))
            assert torch.isnan(y[0, [0, 3, 4]]).all()
            assert not torch.isnan(y[0, [1, 2, 5]]).any()
            assert y[0, 1, 4] == inf and y[0, 2, 5] == -inf  # max * 2^(128-emax) overflows float32
            ref = block_view(ao.dequantize(ours, torch.float32))
            assert_same_bits(y[0, [1, 2, 5]], ref[0, [1, 2, 5]])


def test_quark_zero_convention(ao):
    """We write torchao's -0 codes; Quark writes +0. Mapping 0x8 -> 0x0 changes no value."""
    x = make_blocks(4, 4, -2, 2, torch.float32, seed=11)
    x[:, ::5] = -1e-6  # negatives that round to zero
    x[:, 1] = -0.0
    ours = quantize_mx(x, MXFP4, "even")
    _, ao_codes = ao.quantize(x, MXFP4, "even")
    codes = unpack_codes(ours)
    assert_same_bits(codes, ao_codes)
    assert (codes == 0x8).any()
    quark_style = torch.where(codes == 0x8, torch.zeros_like(codes), codes)
    as_quark = ours._replace(codes=pack_fp4(quark_style))
    a, b = dequantize_mx(ours, torch.float32), dequantize_mx(as_quark, torch.float32)
    assert torch.equal(a, b)  # equal as values (-0 == +0)
    assert (torch.signbit(a) != torch.signbit(b)).any()  # but not as bits


# ---------------------------------------------------------------------------------------------
# round trip, shapes, errors


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_error_bound(name, mode):
    """|x - dq(q(x))| <= X * max(half the top ulp, top - max_normal), where top bounds |x| / X:
    2^(emax+1) for floor, and (2 - 2^-(mbits+1)) * 2^emax for even, whose amax rounding moves
    any block that would round past the top binade up a scale. (E4M3 saturates hardest: its
    max is 1.75 * 2^8, the 1.875 slot being NaN.)"""
    fmt = get_mx_format(name)
    x = make_blocks(16, 8, -130, 60, torch.float32, seed=12)
    mx = quantize_mx(x, fmt, mode)
    y = dequantize_mx(mx, torch.float32)
    if mode == "floor":
        top = 2.0 ** (fmt.emax + 1)
    else:
        top = (2 - 2.0 ** -(fmt.mbits + 1)) * 2.0**fmt.emax
    factor = max(2.0 ** (fmt.emax - fmt.mbits - 1), top - fmt.max_normal)
    X = e8m0_to_float(mx.scales).double().unsqueeze(-1)  # [rows, blocks, 1]
    err = block_view((y.double() - x.double()).abs())
    assert (err <= X * factor).all()
    assert (err > X * factor / 2).any()  # and the bound is not loose by 2x
    # bf16 output is the float32 output rounded once, subnormal blocks included
    assert_same_bits(dequantize_mx(mx, torch.bfloat16), y.to(torch.bfloat16))
    # relative to the block max, which is >= 2^emax X (floor) or (1 - 2^-(mbits+2)) 2^emax X
    # (even) unless the scale was clamped at byte 0
    rel = (err.amax(-1) / block_view(x.double()).abs().amax(-1))[mx.scales > 0]
    least_amax = 2.0**fmt.emax * (1 if mode == "floor" else 1 - 2.0 ** -(fmt.mbits + 2))
    assert rel.max() <= factor / least_amax


@pytest.mark.parametrize("name", FORMATS)
def test_shapes_and_dtypes(name):
    fmt = get_mx_format(name)
    storage = {4: 16, 6: 24, 8: 32}[fmt.bits]  # bytes per block of 32
    for shape in [(64,), (3, 64), (2, 3, 4, 96)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        mx = quantize_mx(x, fmt)
        assert mx.shape == x.shape and mx.dtype == torch.bfloat16 and mx.block_size == 32
        assert mx.codes.dtype == torch.uint8 and mx.scales.dtype == torch.uint8
        assert mx.codes.shape == (*shape[:-1], shape[-1] // 32 * storage)
        assert mx.scales.shape == (*shape[:-1], shape[-1] // 32)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            y = dequantize_mx(mx, dtype)
            assert y.shape == x.shape and y.dtype == dtype
        assert_same_bits(dequantize_mx(mx, torch.float16), dequantize_mx(mx, torch.float32).half())
    # fp16 and fp64 inputs; a non-contiguous input
    x = torch.randn(4, 64)
    assert_same_bits(quantize_mx(x.half(), fmt).codes, quantize_mx(x.half().float(), fmt).codes)
    assert_same_bits(quantize_mx(x.double(), fmt).codes, quantize_mx(x, fmt).codes)
    xt = torch.randn(64, 4).t()
    assert_same_bits(quantize_mx(xt, fmt).codes, quantize_mx(xt.contiguous(), fmt).codes)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="divisible by block_size=32"):
        quantize_mx(torch.randn(4, 48), "mxfp4")
    with pytest.raises(ValueError, match="divisible by block_size=32"):
        quantize_mx(torch.tensor(1.0), "mxfp4")
    with pytest.raises(ValueError, match="block_size must be positive"):
        quantize_mx(torch.randn(4, 64), "mxfp4", block_size=0)
    with pytest.raises(ValueError, match="mxfp6_e2m3 packs 4"):
        quantize_mx(torch.randn(4, 6), "mxfp6_e2m3", block_size=2)
    with pytest.raises(ValueError, match="scale_mode"):
        quantize_mx(torch.randn(4, 64), "mxfp4", scale_mode="ceil")
    with pytest.raises(ValueError, match="unknown MX format"):
        quantize_mx(torch.randn(4, 64), "fp4")
    with pytest.raises(ValueError, match="floating-point"):
        quantize_mx(torch.ones(4, 64, dtype=torch.int32), "mxfp8")
    with pytest.raises(ValueError, match="bits"):
        MXFormat("bad", bits=5, ebits=2, mbits=1, emax=2, max_normal=6.0)
