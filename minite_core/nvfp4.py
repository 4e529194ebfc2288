"""NVFP4: the 4-bit floating-point format miniTE computes in, as plain PyTorch.

An NVFP4 tensor stores each element as an E2M1 code (1 sign, 2 exponent, 1 mantissa bit), whose
magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Every 16 consecutive elements of the last dimension share
an FP8 E4M3 block scale, and the whole tensor (scale_mode="tensor") or each row (scale_mode="row")
has an FP32 global scale. A value decodes as

    x ~= code * block_scale * global_scale

The global scale uses the *decode* convention, global_scale = amax / (6 * 448): the largest block
then gets a block scale near 448, the top of E4M3, and every block keeps E4M3's 3 mantissa bits.
Quantization follows the public reference (torchao's `nvfp4_quantize`) operation for operation, so
the bits agree with it exactly:

    block_scale  = e4m3(clamp(block_amax / 6 / global_scale, 2^-6, 448))      (RNE)
    code         = e2m1(clamp(x * ((1 / global_scale) / block_scale), -6, 6))  (RNE, ties to even)

The lower clamp at 2^-6 (E4M3's smallest normal) is the reference's; it means quantize never writes
a subnormal block scale, while dequantize and the GEMMs decode subnormal scales that other
producers' checkpoints may hold. Zero blocks get the scale 2^-6 and codes 0; an all-zero row or
tensor gets a tiny positive global scale, so nothing divides by zero.

Why per-row global scales are the default: a per-tensor scale of an activation depends on every
other row in the batch, so the same token quantizes differently alone and in a batch. A per-row
(per-token) scale depends on the row alone: batch-invariant, and never stale.

Options for training (NVIDIA's NVFP4 recipe and follow-ups):
- block_2d: 16x16 tiles of a weight share one block scale (stored repeated in the same [.., K/16]
  layout). With a per-tensor global scale, quantize(w) and quantize(w.T) then hold the same values,
  so one quantized weight serves the forward GEMM and the data-gradient GEMM.
- rounding="stochastic": round up with probability equal to the distance from the lower grid point,
  so E[dequantize(quantize(x))] = x (for gradients).
- random Hadamard transform (`rht`): a seeded orthogonal 16x16 rotation applied along the reduction
  dimension of both wgrad operands; it spreads outliers across a block and cancels in the product.
- four_over_six: each block tries scaling its max to 4 as well as 6 and keeps whichever has the
  smaller squared error; this avoids the wide 4 -> 6 gap for near-maximal values. The global scale
  becomes amax / (4 * 448) so that both candidates fit E4M3.

Scales can be rearranged into the 128x4 swizzled layout that cuBLASLt and Blackwell tensor cores read
(`to_blocked` / `from_blocked`).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .reduce import tree_sum

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
GS_MIN = 2.0**-100  # floor on a computed global scale: 1/gs and 1/gs/2^-6 stay finite in fp32

# code -> value, codes 0..15 (bit 3 is the sign; code 8 is -0.0)
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(_E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES), dtype=torch.float32)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LUTS: dict = {}  # lookup tables, copied to a device once (no host-to-device copy per call: CUDA graphs capture)


def e2m1_values(device) -> torch.Tensor:
    """E2M1_VALUES on `device`."""
    device = torch.device(device)
    if device not in _LUTS:
        _LUTS[device] = E2M1_VALUES.to(device)
    return _LUTS[device]


@dataclasses.dataclass
class NVFP4Tensor:
    """A quantized tensor of logical `shape` [..., K].

    data:         uint8 [..., K//2], element 2i in the low nibble, 2i+1 in the high nibble.
    scale:        float8_e4m3fn [..., K//16].
    global_scale: float32, decode convention; shape [] (per tensor) or [..., 1] (per row).
    decoded:      optional: fp16 code * block scale [rows, K padded] in the wide W4A4 tile's layout
                  (`kernels.gemm.decode_nvfp4`), written with the codes by the kernel that made them (the
                  learner's re-quantize of its weights, the quantizing row ops of activations that feed wide
                  tiles), so that the GEMM need not decode them again; the values the GEMM would decode.
    dequantized:  optional: bf16 [..., K], `dequantize(self, torch.bfloat16)`'s values, written with the codes
                  by the learner's re-quantize of its weights (`kernels.quantize.quantize_many_triton`), so
                  that the straight-through backward need not dequantize each weight at every step.
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size
    decoded: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    dequantized: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.shape = torch.Size(self.shape)
        if len(self.shape) == 0 or self.shape[-1] <= 0 or self.shape[-1] % BLOCK:
            raise ValueError(f"NVFP4Tensor.shape {tuple(self.shape)}: the last dimension must be a positive multiple of {BLOCK}")
        k = self.shape[-1]
        lead = tuple(self.shape[:-1])
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != lead + (k // 2,):
            raise ValueError(f"NVFP4Tensor.data must be uint8 {lead + (k // 2,)}, got {self.data.dtype} {tuple(self.data.shape)}")
        if self.scale.dtype != torch.float8_e4m3fn or tuple(self.scale.shape) != lead + (k // BLOCK,):
            raise ValueError(
                f"NVFP4Tensor.scale must be float8_e4m3fn {lead + (k // BLOCK,)}, got {self.scale.dtype} {tuple(self.scale.shape)}"
            )
        gs = self.global_scale
        if gs.dtype != torch.float32 or not (gs.dim() == 0 or tuple(gs.shape) == lead + (1,)):
            raise ValueError(f"NVFP4Tensor.global_scale must be float32 [] or {lead + (1,)}, got {gs.dtype} {tuple(gs.shape)}")
        rows = math.prod(lead)
        if self.decoded is not None and (self.decoded.dtype != torch.float16 or self.decoded.dim() != 2
                                         or self.decoded.shape[0] != rows or self.decoded.shape[1] < k):
            raise ValueError(f"NVFP4Tensor.decoded must be float16 [{rows}, >= {k}], got "
                             f"{self.decoded.dtype} {tuple(self.decoded.shape)} for shape {tuple(self.shape)}")
        if self.dequantized is not None and (self.dequantized.dtype != torch.bfloat16
                                             or tuple(self.dequantized.shape) != tuple(self.shape)):
            raise ValueError(f"NVFP4Tensor.dequantized must be bfloat16 {tuple(self.shape)}, got "
                             f"{self.dequantized.dtype} {tuple(self.dequantized.shape)}")

    @classmethod
    def trusted(cls, data, scale, global_scale, shape, decoded=None, dequantized=None) -> "NVFP4Tensor":
        """An NVFP4Tensor of parts that our own code has just made consistent (a kernel's outputs, a reshape or a
        part-drop of a checked tensor), built without `__post_init__`'s checks: those cost ~5 µs a tensor on a
        CPU, and a learner forward builds ~300 (the GPU waits on its host there). Not for parts from a user."""
        t = object.__new__(cls)
        t.data, t.scale, t.global_scale, t.shape = data, scale, global_scale, torch.Size(shape)
        t.decoded, t.dequantized = decoded, dequantized
        return t

    def rows(self) -> "NVFP4Tensor":
        """The same codes as a 2-D [rows, K] tensor (views of the parts where they allow, else copies); the
        decoded form, already [rows, K padded], is kept."""
        if len(self.shape) == 2:
            return self
        k = self.shape[-1]
        gs = self.global_scale if self.global_scale.dim() == 0 else self.global_scale.reshape(-1, 1)
        return NVFP4Tensor.trusted(self.data.reshape(-1, k // 2), self.scale.reshape(-1, k // BLOCK), gs,
                                   (self.data.numel() * 2 // k, k), self.decoded)

    def without_caches(self) -> "NVFP4Tensor":
        """The same codes without the decoded and dequantized forms (what a saved activation keeps)."""
        return NVFP4Tensor.trusted(self.data, self.scale, self.global_scale, self.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def per_row(self) -> bool:
        return self.global_scale.dim() > 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.global_scale))

    def to(self, device) -> "NVFP4Tensor":
        return NVFP4Tensor(self.data.to(device), self.scale.to(device), self.global_scale.to(device), self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


# ---------------------------------------------------------------------------------------------- checks


def check_float_input(x: torch.Tensor, name: str, *, check_finite: bool = True) -> None:
    """Raise TypeError/ValueError naming `name` unless x is a float tensor [..., K], K % 16 == 0."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % BLOCK != 0:
        raise ValueError(f"{name} has shape {tuple(x.shape)}: its last dimension must be a positive multiple of {BLOCK}")
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf values")


def _check_global_scale(gs, rows_shape: tuple, device) -> torch.Tensor:
    gs = torch.as_tensor(gs, dtype=torch.float32, device=device)
    if not (gs.dim() == 0 or gs.numel() == 1 or tuple(gs.shape) == rows_shape + (1,)):
        raise ValueError(f"global_scale must be a scalar or of shape {rows_shape + (1,)}, got {tuple(gs.shape)}")
    if gs.numel() == 1 and gs.dim() > 0:
        gs = gs.reshape(())
    if not bool(torch.isfinite(gs).all()) or bool((gs < GS_MIN).any()):
        raise ValueError(f"global_scale must be finite and >= {GS_MIN:.3g} (decode convention amax/2688)")
    return gs


def div(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b correctly rounded on every device. (PyTorch's CUDA kernels divide by a Python scalar by
    multiplying with its reciprocal, which is off by an ulp now and then; a tensor divisor is exact.)"""
    return a / torch.full_like(a, b)


def global_scale_from_amax(amax: torch.Tensor, *, four_over_six: bool = False) -> torch.Tensor:
    """Decode-convention global scale amax / (6 * 448) (or / (4 * 448) for 4over6), floored at GS_MIN."""
    top = (4.0 if four_over_six else E2M1_MAX) * E4M3_MAX
    return torch.clamp_min(div(amax.float(), top), GS_MIN)


# ---------------------------------------------------------------------------------------------- rounding


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """RNE of fp32 values (already within [-6, 6]) to E2M1 codes, uint8 0..15.

    The code of |v| counts the rounding thresholds it passes; a tie goes to the even code, so the
    thresholds at 0.25, 1.25, 2.5, 5 are strict (tie rounds down) and those at 0.75, 1.75, 3.5 are not.
    """
    a = v.abs()
    code = (
        (a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def round_e2m1_stochastic(v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unbiased stochastic rounding of fp32 values within [-6, 6] to E2M1 codes."""
    a = v.abs()
    lo_code = (
        (a >= 0.5).to(torch.uint8) + (a >= 1.0).to(torch.uint8) + (a >= 1.5).to(torch.uint8)
        + (a >= 2.0).to(torch.uint8) + (a >= 3.0).to(torch.uint8) + (a >= 4.0).to(torch.uint8)
        + (a >= 6.0).to(torch.uint8)
    )
    mags = e2m1_values(v.device)[:8]
    lo = mags[lo_code.long()]
    hi = mags[torch.clamp_max(lo_code + 1, 7).long()]
    p = torch.where(hi > lo, (a - lo) / (hi - lo), torch.zeros_like(a))
    u = torch.rand(a.shape, generator=generator, device=v.device)
    code = lo_code + (u < p).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes -> [..., K//2] bytes, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(data: torch.Tensor) -> torch.Tensor:
    """[..., K//2] bytes -> [..., K] uint8 codes."""
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------- quantize


def _block_scales(block_amax: torch.Tensor, gs: torch.Tensor, target: float):
    """E4M3 block scales and the fp32 multipliers x -> x / (gs * scale), as the reference computes them."""
    scaled = div(block_amax, target) / gs
    scale = torch.clamp(scaled, min=E4M3_MIN_NORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
    recip = (torch.ones_like(gs) / gs) / scale.float()
    return scale, recip


def _tile_amax_2d(blocks: torch.Tensor) -> torch.Tensor:
    """Per-16x16-tile amax of rows-of-blocks [R, nb, 16], repeated back to [R, nb]."""
    r, nb, _ = blocks.shape
    pad = (-r) % BLOCK
    a = blocks.abs().amax(-1)
    if pad:
        a = torch.cat((a, a.new_zeros(pad, nb)))
    tiles = a.view(-1, BLOCK, nb).amax(1)
    return tiles.repeat_interleave(BLOCK, dim=0)[:r]


def quantize(
    x: torch.Tensor,
    *,
    global_scale: torch.Tensor | float | None = None,
    scale_mode: str = "row",
    block_2d: bool = False,
    rounding: str = "rne",
    generator: torch.Generator | None = None,
    four_over_six: bool = False,
    check_finite: bool = True,
) -> NVFP4Tensor:
    """Quantize a float tensor [..., K] (K % 16 == 0) to NVFP4.

    scale_mode "row" gives each row [..., :] its own global scale, "tensor" one for the whole tensor; an
    explicit `global_scale` (scalar or [..., 1], decode convention) overrides both.
    """
    check_float_input(x, "x", check_finite=check_finite)
    if scale_mode not in ("row", "tensor"):
        raise ValueError(f"scale_mode must be 'row' or 'tensor', got {scale_mode!r}")
    if rounding not in ("rne", "stochastic"):
        raise ValueError(f"rounding must be 'rne' or 'stochastic', got {rounding!r}")
    shape = x.shape
    k = shape[-1]
    rows_shape = tuple(shape[:-1])
    xf = x.float().reshape(-1, k)
    blocks = xf.view(xf.shape[0], k // BLOCK, BLOCK)

    if global_scale is not None:
        gs = _check_global_scale(global_scale, rows_shape, x.device)
    elif scale_mode == "row":
        gs = global_scale_from_amax(xf.abs().amax(-1).reshape(rows_shape + (1,)), four_over_six=four_over_six)
    else:
        gs = global_scale_from_amax(xf.abs().amax() if xf.numel() else xf.new_zeros(()), four_over_six=four_over_six)
    if block_2d and gs.dim() > 0:
        raise ValueError("block_2d needs one global scale for the tensor (scale_mode='tensor' or a scalar global_scale)")
    gs_rows = gs.reshape(-1, 1) if gs.dim() > 0 else gs  # [R, 1] or []

    block_amax = _tile_amax_2d(blocks) if block_2d else blocks.abs().amax(-1)

    def encode(target: float):
        scale, recip = _block_scales(block_amax, gs_rows, target)
        v = torch.clamp(blocks * recip.unsqueeze(-1), -E2M1_MAX, E2M1_MAX)
        codes = round_e2m1(v) if rounding == "rne" else round_e2m1_stochastic(v, generator)
        return scale, codes

    scale, codes = encode(E2M1_MAX)
    if four_over_six:
        scale4, codes4 = encode(4.0)
        gsb = gs_rows.unsqueeze(-1) if gs_rows.dim() else gs_rows

        def sq_err(s, c):
            deq = (e2m1_values(x.device)[c.long()] * s.float().unsqueeze(-1)) * gsb
            return (deq - blocks).square().sum(-1)

        use4 = sq_err(scale4, codes4) < sq_err(scale, codes)
        scale = torch.where(use4, scale4.view(torch.uint8), scale.view(torch.uint8)).view(torch.float8_e4m3fn)
        codes = torch.where(use4.unsqueeze(-1), codes4, codes)

    data = pack_codes(codes.reshape(-1, k)).reshape(rows_shape + (k // 2,))
    return NVFP4Tensor(data, scale.reshape(rows_shape + (k // BLOCK,)), gs, shape)


def _pair_lut(device, dtype) -> torch.Tensor:
    """[256, 2]: the two E2M1 values a packed byte holds (low nibble first), copied once per device/dtype."""
    key = (torch.device(device), dtype)
    if key not in _LUTS:
        b = torch.arange(256)
        _LUTS[key] = torch.stack((E2M1_VALUES[b & 0xF], E2M1_VALUES[b >> 4]), -1).to(key[0], dtype)
    return _LUTS[key]


def _code_times_scale(t: NVFP4Tensor, mid: torch.dtype) -> torch.Tensor:
    """code * block scale in `mid` [..., K/16, 16]: one byte -> value-pair lookup, then the block scale in place.
    Exact in fp32, and in bf16 too (a 2-bit times a 4-bit significand, exponents within bf16's range)."""
    k = t.shape[-1]
    vals = _pair_lut(t.device, mid)[t.data.int()].reshape(*t.shape[:-1], k // BLOCK, BLOCK)
    return vals.mul_(t.scale.to(mid).unsqueeze(-1))


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode to `dtype`: code * block_scale (exact), times the global scale in fp32 (one rounding), then
    rounded to `dtype`. For a bf16 result the exact part is built in bf16 (half the bytes); the product
    with the fp32 global scale is still taken in fp32 and written straight into `dtype`."""
    vals = _code_times_scale(t, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    # a dimensioned fp32 global scale, so the product is taken in fp32 (a 0-dim one would not promote)
    gs = t.global_scale.unsqueeze(-1) if t.global_scale.dim() else t.global_scale.view(*([1] * vals.dim()))
    out = torch.empty(vals.shape, dtype=dtype, device=vals.device)
    torch.mul(vals, gs, out=out)
    return out.view(t.shape)


def dequantize_unscaled(t: NVFP4Tensor) -> torch.Tensor:
    """code * block_scale in fp32 (exact; no global scale): the operand the GEMMs multiply."""
    return _code_times_scale(t, torch.float32).reshape(t.shape)


# ---------------------------------------------------------------------------------------------- RHT


def hadamard_matrix(seed: int = 0, device=None) -> torch.Tensor:
    """The 16x16 random Hadamard rotation Q = diag(signs) @ H16 / 4 (orthogonal: Q @ Q.T = I)."""
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (BLOCK,), generator=g).float() * 2 - 1
    return (signs[:, None] * h / 4.0).to(device)


def rht(x: torch.Tensor, seed: int = 0, *, inverse: bool = False) -> torch.Tensor:
    """Rotate each 16-block of the last dimension by the seeded random Hadamard matrix.

    Applied to both operands along their shared reduction dimension it cancels:
    rht(a) @ rht(b).T == a @ b.T (up to rounding); `inverse=True` undoes it on one tensor.
    """
    check_float_input(x, "x", check_finite=False)
    q = hadamard_matrix(seed, x.device)
    if inverse:
        q = q.T
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    return tree_sum(xb.unsqueeze(-1) * q, dim=-2).reshape(x.shape).to(x.dtype)  # fixed order, no BLAS


# ---------------------------------------------------------------------------------------------- layouts


def _blocked_index(rows: int, cols: int, device=None) -> torch.Tensor:
    """Offset of each (row, col) of a [rows_padded, cols_padded] scale matrix in the 128x4 swizzle.

    The matrix is cut into 128x4 tiles stored row-major by tile; inside a tile, scale (r, c) sits at
    (r % 32) * 16 + (r // 32) * 4 + c, so the four 32-row groups interleave.
    """
    r = torch.arange(rows, device=device).view(-1, 1)
    c = torch.arange(cols, device=device).view(1, -1)
    col_tiles = cols // 4
    tile = (r // 128) * col_tiles + c // 4
    rr, cc = r % 128, c % 4
    return tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """[H, W] block scales -> flat swizzled 128x4 layout (H padded to 128, W to 4, with zeros)."""
    if scale.dim() != 2:
        raise ValueError(f"to_blocked needs a 2-D scale matrix, got shape {tuple(scale.shape)}")
    h, w = scale.shape
    hp, wp = -(-h // 128) * 128, -(-w // 4) * 4
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    padded = raw.new_zeros(hp, wp)
    padded[:h, :w] = raw
    out = raw.new_empty(hp * wp)
    out[_blocked_index(hp, wp, scale.device).flatten()] = padded.flatten()
    return out.view(scale.dtype) if scale.dtype == torch.float8_e4m3fn else out


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `to_blocked`: the flat swizzled layout back to [rows, cols]."""
    hp, wp = -(-rows // 128) * 128, -(-cols // 4) * 4
    if blocked.numel() != hp * wp:
        raise ValueError(f"blocked scales hold {blocked.numel()} values, expected {hp * wp} for [{rows}, {cols}]")
    raw = blocked.view(torch.uint8) if blocked.dtype == torch.float8_e4m3fn else blocked
    full = raw.flatten()[_blocked_index(hp, wp, blocked.device)]
    out = full[:rows, :cols].contiguous()
    return out.view(blocked.dtype) if blocked.dtype == torch.float8_e4m3fn else out

