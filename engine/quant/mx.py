# over 400 lines: the OCP MX v1.0 formats (element encodings, shared scales, quantize / dequantize) as one spec in one file.
"""OCP Microscaling (MX) v1.0 block formats: MXFP4, MXFP6 (E2M3, E3M2) and MXFP8 (E4M3).

A block of `block_size` (32 in the spec) consecutive elements along the last dim shares one
E8M0 scale X = 2^(s - 127), s in 0..254, s = 0xFF = NaN (no zero, no sign). Each element is
stored as a small float P_i; the block decodes to v_i = X * P_i, and to NaN everywhere if X
is NaN. Conversion follows the spec's section 6.3, amax being the block's largest |x_i|:

    X   = 2^(floor(log2(amax)) - emax_elem)           scale_mode="floor" (the spec's rule)
    X   = 2^(floor(log2(rne_m(amax))) - emax_elem)    scale_mode="even" (Quark's default,
          torchao EVEN): amax is first rounded half-to-even to the element's m mantissa bits,
          so an amax whose top m+1 mantissa bits are all ones moves up a binade, not saturating
    X is clamped to 2^-127 .. 2^127; amax = 0 gives byte 0.
    P_i = rne(x_i / X) saturated to +-max_normal

Storage of `MXTensor.codes` (K = last dim):
    mxfp4      [..., K/2]   two codes a byte, element 2i in the low nibble, 2i+1 in the high
                            nibble (torchao pack_uint4, c10 Float4_e2m1fn_x2, Quark export)
    mxfp6_*    [..., 3K/4]  four codes in three bytes, the little-endian 24-bit word
                            v0 | v1 << 6 | v2 << 12 | v3 << 18 (amd-quark `Pack_fp6`, the operand
                            layout of the CDNA4 mfma_scale f8f6f4 instructions). torchao's MX path
                            keeps fp6 unpacked, one code a byte; `unpack_codes` gives that view.
    mxfp8      [..., K]     the float8_e4m3fn bit pattern
    scales     [..., K/block_size] uint8 E8M0

Bit-compatibility with torchao 0.18 `to_mx` (FLOOR / EVEN) -- identical scales always, identical
codes except where noted:
  * signed zero: the sign is kept, so -0 and negatives that round to zero get the negative-zero
    code (0x8 for fp4) as torchao does; Quark writes +0 there (compare after mapping).
  * all-zero block -> scale byte 0.
  * NaN in a block -> scale 0xFF. The elements of such a block are don't-care (they decode to NaN):
    finite ones get +-0 as in torchao; NaN/Inf elements get an unspecified code (fp8: the
    e4m3 NaN, as torchao; torchao's fp4/fp6 bit trick writes an artifact of the NaN payload).
  * +-Inf without NaN is the largest magnitude (its exponent field 255 gives X = 2^(128-emax));
    Inf elements saturate to +-max, finite ones flush to +-0, as torchao.
  * scale byte 0 with non-zero elements (amax < 2^(emax-126), e.g. 2^-124 for fp4): we divide by
    2^-127, the value the byte decodes to. torchao clamps the fp32 scale to 2^-126 there (a triton
    denormal workaround), so its codes in those blocks are ours halved and its round trip is off
    by 2x. Elsewhere x * 2^-s and torchao's x / 2^s are the same correctly rounded product.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

__all__ = [
    "MXFormat",
    "MXFP4",
    "MXFP6_E2M3",
    "MXFP6_E3M2",
    "MXFP8",
    "MX_FORMATS",
    "MXTensor",
    "SCALE_MODES",
    "ScaleMode",
    "get_mx_format",
    "quantize_mx",
    "dequantize_mx",
    "unpack_codes",
    "decode_codes",
    "code_values",
    "e8m0_to_float",
    "pack_fp4",
    "unpack_fp4",
    "pack_fp6",
    "unpack_fp6",
    "MXSpec",
    "packed_dim",
    "qdq_mx",
]

E8M0_BIAS = 127
E8M0_NAN = 0xFF
ScaleMode = Literal["even", "floor"]
SCALE_MODES: tuple[ScaleMode, ...] = ("even", "floor")
_F32_MBITS = 23


@dataclass(frozen=True, slots=True)
class MXFormat:
    """An MX element type (OCP MX v1.0): a sign bit, `ebits` exponent and `mbits` mantissa bits."""

    name: str
    """CLI / checkpoint name, e.g. "mxfp4"."""
    bits: int
    """Bits per element code, sign included."""
    ebits: int
    """Exponent bits."""
    mbits: int
    """Mantissa (trailing significand) bits."""
    emax: int
    """Unbiased exponent of the largest normal (emax_elem in the spec)."""
    max_normal: float
    """Largest finite magnitude; conversion saturates to it."""

    def __post_init__(self) -> None:
        if self.bits != 1 + self.ebits + self.mbits:
            raise ValueError(f"{self.name}: bits={self.bits} != 1 + {self.ebits} + {self.mbits}")

    @property
    def bias(self) -> int:
        return (1 << (self.ebits - 1)) - 1

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal; subnormals are multiples of 2^(emin-mbits)."""
        return 1 - self.bias

    @property
    def num_codes(self) -> int:
        return 1 << self.bits

    @property
    def sign_mask(self) -> int:
        return 1 << (self.bits - 1)


# OCP MX v1.0 table "Concrete MX-compliant formats". FP4/FP6 have no Inf/NaN; E4M3 (OCP FP8,
# torch float8_e4m3fn) has NaN at S.1111.111 only, so its top exponent still holds normals.
MXFP4 = MXFormat("mxfp4", bits=4, ebits=2, mbits=1, emax=2, max_normal=6.0)
MXFP6_E2M3 = MXFormat("mxfp6_e2m3", bits=6, ebits=2, mbits=3, emax=2, max_normal=7.5)
MXFP6_E3M2 = MXFormat("mxfp6_e3m2", bits=6, ebits=3, mbits=2, emax=4, max_normal=28.0)
MXFP8 = MXFormat("mxfp8", bits=8, ebits=4, mbits=3, emax=8, max_normal=448.0)
MX_FORMATS: dict[str, MXFormat] = {f.name: f for f in (MXFP4, MXFP6_E2M3, MXFP6_E3M2, MXFP8)}


def get_mx_format(fmt: MXFormat | str) -> MXFormat:
    if isinstance(fmt, MXFormat):
        return fmt
    if fmt not in MX_FORMATS:
        raise ValueError(f"unknown MX format {fmt!r}; expected one of {sorted(MX_FORMATS)}")
    return MX_FORMATS[fmt]


class MXTensor(NamedTuple):
    """A tensor in an MX format; see the module docstring for the layout of `codes`."""

    codes: torch.Tensor
    """uint8 element codes in storage layout (packed for fp4 and fp6)."""
    scales: torch.Tensor
    """uint8 E8M0 block scales, [..., K / block_size]."""
    fmt: MXFormat
    shape: torch.Size
    """Shape of the unquantized tensor."""
    dtype: torch.dtype
    """Dtype of the unquantized tensor."""
    block_size: int


# ---------------------------------------------------------------------------------------------
# Code <-> value tables


@functools.cache
def _positive_values(fmt: MXFormat) -> tuple[float, ...]:
    """Values of the codes 0 .. 2^(bits-1)-1 (sign bit clear), increasing."""
    values = []
    for code in range(fmt.sign_mask):
        exp_field, mant = code >> fmt.mbits, code & ((1 << fmt.mbits) - 1)
        if exp_field == 0:  # subnormal: 0.M * 2^emin
            values.append(mant * 2.0 ** (fmt.emin - fmt.mbits))
        else:
            values.append((1 + mant / (1 << fmt.mbits)) * 2.0 ** (exp_field - fmt.bias))
    if fmt.bits == 8:  # E4M3: S.1111.111 is NaN, not 480
        values[-1] = float("nan")
    return tuple(values)


@functools.cache
def _code_values_cpu(fmt: MXFormat) -> torch.Tensor:
    pos = torch.tensor(_positive_values(fmt), dtype=torch.float32)
    return torch.cat([pos, -pos])  # [num_codes]; the sign bit is the top bit


def code_values(fmt: MXFormat | str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16/64/256-entry float32 table: code_values(fmt)[code] = value of that element code."""
    return _code_values_cpu(get_mx_format(fmt)).to(device, copy=True)


@functools.cache
def _round_boundaries_cpu(fmt: MXFormat) -> torch.Tensor:
    """Decision points for round-to-nearest-even over the finite non-negative codes.

    torch.bucketize(a, b) (right=False) returns the number of boundaries strictly below a, which
    is the code of a when b[i] separates code i from code i+1. A tie a == midpoint must go to the
    even code (its mantissa LSB is the code's LSB): with b[i] = midpoint that happens for even i
    (a lands on i); for odd i we lower b[i] to the next float32 below the midpoint so the tie lands
    on i+1. No float32 lies between the two, so all other inputs are unaffected. Inputs above the
    last boundary get the largest finite code: saturation for free.
    """
    pos = torch.tensor(_positive_values(fmt), dtype=torch.float64)
    pos = pos[~torch.isnan(pos)]
    mid = ((pos[1:] + pos[:-1]) / 2).to(torch.float32)  # exact: every midpoint has <= 6 bits
    odd = torch.arange(mid.numel()) % 2 == 1
    return torch.where(odd, torch.nextafter(mid, torch.zeros(())), mid)


@functools.cache
def _e8m0_values_cpu() -> torch.Tensor:
    table = torch.exp2(torch.arange(256, dtype=torch.float64) - E8M0_BIAS).to(torch.float32)
    table[E8M0_NAN] = float("nan")
    return table  # [256]; byte 0 -> 2^-127, a float32 subnormal


@functools.cache
def _e8m0_reciprocals_cpu() -> torch.Tensor:
    # 1/X, exact for every byte (2^-127 .. 2^127 are all float32). NaN scale -> 0, so finite
    # elements of a NaN block become +-0 (like torchao's x / inf) and NaN/Inf stay NaN.
    table = torch.exp2(E8M0_BIAS - torch.arange(256, dtype=torch.float64)).to(torch.float32)
    table[E8M0_NAN] = 0.0
    return table


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> float32 2^(s-127); 0xFF -> NaN."""
    return _e8m0_values_cpu().to(scales.device)[scales.long()]


# ---------------------------------------------------------------------------------------------
# Packing


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 fp4 codes [..., K] (K even) -> [..., K/2]; code 2i in the low nibble, 2i+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got shape {tuple(codes.shape)}")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] fp4 codes; inverse of `pack_fp4`."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """uint8 fp6 codes [..., K] (K % 4 == 0) -> [..., 3K/4] in Quark's `Pack_fp6` layout.

    Four codes v0..v3 form the little-endian 24-bit word v0 | v1 << 6 | v2 << 12 | v3 << 18:
    byte0 = v0 | v1[1:0] << 6, byte1 = v1[5:2] | v2[3:0] << 4, byte2 = v2[5:4] | v3 << 2.
    """
    if codes.shape[-1] % 4:
        raise ValueError(f"pack_fp6 needs a last dim divisible by 4, got {tuple(codes.shape)}")
    v = codes.reshape(*codes.shape[:-1], -1, 4)
    v0, v1, v2, v3 = v[..., 0], v[..., 1], v[..., 2], v[..., 3]
    byte0 = v0 | ((v1 & 0x03) << 6)
    byte1 = (v1 >> 2) | ((v2 & 0x0F) << 4)
    byte2 = (v2 >> 4) | (v3 << 2)
    return torch.stack([byte0, byte1, byte2], dim=-1).flatten(-2)


def unpack_fp6(packed: torch.Tensor) -> torch.Tensor:
    """[..., 3K/4] uint8 -> [..., K] fp6 codes (one per byte, in the low 6 bits)."""
    if packed.shape[-1] % 3:
        raise ValueError(f"unpack_fp6 needs a last dim divisible by 3, got {tuple(packed.shape)}")
    b = packed.reshape(*packed.shape[:-1], -1, 3)
    b0, b1, b2 = b[..., 0], b[..., 1], b[..., 2]
    v0 = b0 & 0x3F
    v1 = (b0 >> 6) | ((b1 & 0x0F) << 2)
    v2 = (b1 >> 4) | ((b2 & 0x03) << 4)
    v3 = b2 >> 2
    return torch.stack([v0, v1, v2, v3], dim=-1).flatten(-2)


def _pack(codes: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    if fmt.bits == 4:
        return pack_fp4(codes)
    if fmt.bits == 6:
        return pack_fp6(codes)
    return codes


def unpack_codes(mx: MXTensor) -> torch.Tensor:
    """One uint8 code per element, shape `mx.shape` (torchao's unpacked view for fp6)."""
    if mx.fmt.bits == 4:
        return unpack_fp4(mx.codes)
    if mx.fmt.bits == 6:
        return unpack_fp6(mx.codes)
    return mx.codes


# ---------------------------------------------------------------------------------------------
# Quantize


def _check_shape(shape: torch.Size, fmt: MXFormat, block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    k = shape[-1] if len(shape) else 0
    if len(shape) == 0 or k % block_size:
        raise ValueError(
            f"last dim of shape {tuple(shape)} must be divisible by block_size={block_size}"
        )
    pack = {4: 2, 6: 4}.get(fmt.bits, 1)
    if k % pack:
        raise ValueError(f"{fmt.name} packs {pack} codes per unit; last dim {k} is not divisible")


def _shared_exponent(amax: torch.Tensor, fmt: MXFormat, scale_mode: ScaleMode) -> torch.Tensor:
    """amax float32 [...] (>= 0 or NaN) -> E8M0 bytes [...] uint8 (OCP MX v1.0 section 6.3)."""
    bits = amax.view(torch.int32)
    exp_field = (bits >> _F32_MBITS) & 0xFF  # floor(log2(amax)) + 127; 0 for 0 and subnormals
    if scale_mode == "even":
        # Round amax to fmt.mbits mantissa bits first. Only the exponent is kept, and it moves up
        # exactly when the mantissa reaches the top rounding midpoint 2 - 2^-(mbits+1); that tie
        # rounds up under half-to-even too (the upper neighbour 2.0 has an even mantissa).
        # Same bits as torchao's `(bits + (1 << (22 - mbits))) & exponent_mask`, carries included
        # (a subnormal amax can reach exponent field 1, FLT_MAX reaches 255).
        threshold = (1 << _F32_MBITS) - (1 << (_F32_MBITS - 1 - fmt.mbits))
        exp_field = exp_field + ((bits & 0x7FFFFF) >= threshold).to(torch.int32)
    shared = (exp_field - E8M0_BIAS - fmt.emax).clamp_(-E8M0_BIAS, E8M0_BIAS)
    scales = (shared + E8M0_BIAS).to(torch.uint8)
    return scales.masked_fill_(torch.isnan(amax), E8M0_NAN)


def _encode_by_bucketize(y: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """Reference encoder, any format without NaN codes: RNE to the nearest code, saturating."""
    negative = torch.signbit(y)
    magnitude = torch.bucketize(y.abs(), _round_boundaries_cpu(fmt).to(y.device), out_int32=True)
    return magnitude.to(torch.uint8) | (negative.to(torch.uint8) << (fmt.bits - 1))


@functools.cache
def _fp4_encode_table_cpu() -> torch.Tensor:
    """[8192] uint8: the fp4 code of each class of float32 that RNE to E2M1 cannot tell apart.

    Every E2M1 value, every midpoint between two of them and the saturation point 6 has at most
    3 significant bits, so no rounding decision falls strictly inside a class (sign, exponent,
    top 3 mantissa bits, sticky = any lower bit set). Index = bits[31:20] * 2 + sticky; each
    entry is the bucketize encoding of one member of its class.
    """
    top = (torch.arange(4096, dtype=torch.int64) << 20).to(torch.int32)
    members = torch.stack([top, top | 1], dim=-1).view(torch.float32).reshape(-1)
    return _encode_by_bucketize(members, MXFP4)


def _encode_fp4(y: torch.Tensor) -> torch.Tensor:
    bits = y.view(torch.int32)
    sticky = (bits & 0xFFFFF) != 0
    index = ((bits >> 19) & 0x1FFE).bitwise_or_(sticky)  # [31:20] * 2 + sticky
    table = _fp4_encode_table_cpu().to(y.device)
    return torch.index_select(table, 0, index.reshape(-1)).reshape(y.shape)


# FP6 rounds through a torch float8 cast (RNE, subnormals included): scaled by 2^shift, E2M3 is
# exactly the slice of E4M3 with exponent field <= 3 and E3M2 that of E5M2 with field <= 7
# (same mantissa width, same subnormal spacing 2^(emin-mbits)), so after clamping to the scaled
# max the float8 bits are the fp6 code with the sign moved from bit 7 to bit 5.
_FP6_CARRIERS = {
    MXFP6_E2M3.name: (torch.float8_e4m3fn, -6),  # emin 0 -> E4M3's emin -6
    MXFP6_E3M2.name: (torch.float8_e5m2, -12),  # emin -2 -> E5M2's emin -14
}


def _prescale_exponent(fmt: MXFormat) -> int:
    """Power of two folded into 1/X before `_encode_elements` (non-zero only for FP6)."""
    return _FP6_CARRIERS[fmt.name][1] if fmt.name in _FP6_CARRIERS else 0


def _encode_elements(y: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    """Scaled float32 elements -> uint8 codes (one per byte): RNE, saturating to +-max_normal.

    `y` is x / X times 2^_prescale_exponent(fmt); it may be overwritten.
    """
    if fmt.bits == 4:
        return _encode_fp4(y)
    carrier, shift = _FP6_CARRIERS.get(fmt.name, (torch.float8_e4m3fn, 0))
    bound = fmt.max_normal * 2.0**shift
    # Clamp first: finite overflow saturates (NaN passes through and stays don't-care).
    bits = y.clamp_(-bound, bound).to(carrier).view(torch.uint8)
    if fmt.bits == 8:
        return bits
    return (bits & (fmt.sign_mask - 1)) | ((bits >> (8 - fmt.bits)) & fmt.sign_mask)


def quantize_mx(
    x: torch.Tensor,
    fmt: MXFormat | str,
    scale_mode: ScaleMode = "even",
    block_size: int = 32,
) -> MXTensor:
    """Quantize `x` [..., K] to an MX format in blocks of `block_size` along the last dim.

    scale_mode: "even" (Quark's default, torchao EVEN) or "floor" (the spec's rule); see the
    module docstring. bf16 / fp16 / fp32 inputs are used exactly; other float dtypes are cast
    to float32 first.
    """
    fmt = get_mx_format(fmt)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if not x.is_floating_point():
        raise ValueError(f"quantize_mx needs a floating-point tensor, got {x.dtype}")
    _check_shape(x.shape, fmt, block_size)

    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    blocks = x.contiguous().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    lo, hi = torch.aminmax(blocks, dim=-1)  # [..., num_blocks]; NaN propagates
    amax = torch.maximum(-lo, hi).float()
    scales = _shared_exponent(amax, fmt, scale_mode)

    inv_scale = _e8m0_reciprocals_cpu().to(x.device)[scales.long()]
    inv_scale = inv_scale * 2.0 ** _prescale_exponent(fmt)  # exact; >= 2^-139
    # [..., num_blocks, block_size] float32 (bf16/fp16 promote exactly). A power-of-two product:
    # the same correctly rounded value as torchao's x / X, and any float32 subnormal it rounds
    # is far below half the smallest element subnormal, so it encodes to 0 either way.
    y = blocks * inv_scale.unsqueeze(-1)
    codes = _encode_elements(y, fmt).reshape(x.shape)
    return MXTensor(_pack(codes, fmt), scales, fmt, x.shape, x.dtype, block_size)


# ---------------------------------------------------------------------------------------------
# Dequantize


@functools.cache
def _fp4_pair_values_cpu(dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: a packed fp4 byte -> (value of the low nibble, value of the high nibble)."""
    table = _code_values_cpu(MXFP4)
    byte = torch.arange(256)
    return torch.stack([table[byte & 0x0F], table[byte >> 4]], dim=-1).to(dtype)


def decode_codes(
    codes: torch.Tensor, fmt: MXFormat | str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Unpacked element codes (uint8, any shape) -> element values via the LUT, unscaled."""
    table = code_values(fmt, codes.device).to(dtype)
    return torch.index_select(table, 0, codes.reshape(-1).int()).reshape(codes.shape)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # Element * 2^k is exact in float32 (<= 4 significant bits, exponent >= -136), so one rounding
    # to `dtype` follows. bf16 and fp32 cover the whole E8M0 range, so their product rounds that
    # same exact value once; fp16 does not (2^-127 underflows), so it goes through float32.
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def dequantize_mx(mx: MXTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode an MXTensor to `dtype`, shape `mx.shape`: v = X * P, NaN for a 0xFF scale."""
    work = _work_dtype(dtype)
    if mx.fmt.bits == 4:
        # One gather per packed byte yields both nibbles' values, already interleaved.
        pairs = _fp4_pair_values_cpu(work).to(mx.codes.device)
        values = torch.index_select(pairs, 0, mx.codes.reshape(-1).int())
    else:
        values = decode_codes(unpack_codes(mx), mx.fmt, work)
    values = values.reshape(*mx.scales.shape, mx.block_size)
    scale = e8m0_to_float(mx.scales).to(work)
    return (values * scale.unsqueeze(-1)).reshape(mx.shape).to(dtype)


# ---------------------------------------------------------------------------------------------
# Storage helpers for modules and checkpoints


@dataclass(frozen=True, slots=True)
class MXSpec:
    """How one tensor is quantized: element format, block size and scale rule."""

    fmt: MXFormat
    """Element format (mxfp4, mxfp6_e2m3, mxfp6_e3m2, mxfp8)."""
    block_size: int = 32
    """Elements per E8M0 scale along the last dim (32 in OCP MX v1.0)."""
    scale_mode: ScaleMode = "even"
    """Shared-exponent rule used when quantizing ("even": Quark's default; "floor": the spec's)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")

    def codes_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Storage shape of `codes` for an unquantized tensor of `shape`."""
        return (*shape[:-1], packed_dim(self.fmt, shape[-1]))

    def scales_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] // self.block_size)


def packed_dim(fmt: MXFormat | str, k: int) -> int:
    """Bytes of packed codes for a last dim of `k` elements (k/2 fp4, 3k/4 fp6, k fp8)."""
    bits = get_mx_format(fmt).bits
    return k * bits // 8


def qdq_mx(x: torch.Tensor, spec: MXSpec) -> torch.Tensor:
    """Quantize then dequantize `x` along its last dim (dynamic MX activation quantization)."""
    mx = quantize_mx(x, spec.fmt, spec.scale_mode, spec.block_size)
    return dequantize_mx(mx, x.dtype)
