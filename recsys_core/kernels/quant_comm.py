"""Byte formats of the quantized embedding collectives (FBGEMM's ``quantize_comm`` numerics).

Each encoder takes float32 and returns uint8; each decoder returns float32.

* **hfp8**: one byte per element, ``1 sign | ebits exponent | 7 - ebits mantissa`` with the
  given exponent bias, gradual underflow, magnitudes clamped to ``max_pos`` (NaN too),
  round to nearest even. FBGEMM's forward format is 1-4-3 with bias 15 (``max_pos`` 0.9375).
* **FP8 row-wise**: per row of ``D`` floats, ``scale = max_pos / (max|x| + 1e-20)``; the row is
  ``hfp8(x * scale)`` (1-4-3 bias 15 forward, 1-5-2 bias 31 backward), padded to a multiple
  of 4 bytes, then the fp32 scale and 4 unused bytes. Decoding divides by the scale::

      D = 6:  [q0 q1 q2 q3 q4 q5 _ _ | scale (4 B) | unused (4 B)]   -> 16 bytes

* **INT8 row-wise** (FBGEMM's fused 8-bit): ``scale = (max - min) / 255``, ``bias = min``,
  ``q = round_half_even((x - min) * inverse)``, ``inverse = 255 / (max - min + 1e-8)``; the row is the ``D`` bytes,
  padded to a multiple of 4, then fp32 scale and fp32 bias. Decoding: ``q * scale + bias``.
* **MX4**: FBGEMM's reference implementation (needs fbgemm_gpu).

FBGEMM's CPU ops are used where they exist (hfp8, and INT8 rows whose ``D`` is a multiple of 4,
where FBGEMM's CPU layout equals its GPU layout); the pure-torch code below has the same
numerics and runs otherwise (FBGEMM has no CPU op for FP8 row-wise).
"""

from __future__ import annotations

import torch

from recsys_core.kernels._fbgemm import fbgemm_available

_FP8_EPS = 1e-20
_INT8_EPS = 1e-8
HFP8_FWD = (4, 15, 0.9375)  # ebits, bias, max_pos
HFP8_BWD = (5, 31, 0.875)


def hfp8_max_pos(ebits: int, bias: int) -> float:
    """The largest finite magnitude FBGEMM's hfp8 clamps to."""
    mbits = 7 - ebits
    return 2.0 ** ((1 << ebits) - 2 - bias) * (2 - 2.0**-mbits)


def aligned_row_bytes(row_dim: int) -> int:
    """Bytes of one encoded row (FP8 or INT8 row-wise): ``D`` rounded up to 4, plus 8."""
    return (row_dim + 3) // 4 * 4 + 8


# -- hfp8 ----------------------------------------------------------------------------------------


def _hfp8_encode_torch(x: torch.Tensor, ebits: int, bias: int, max_pos: float) -> torch.Tensor:
    mbits = 7 - ebits
    x = x.float()
    sign = torch.signbit(x)
    a = torch.fmin(x.abs(), torch.tensor(max_pos))  # fmin: NaN clamps to max_pos as FBGEMM
    _, exp = torch.frexp(a)  # a = m * 2^exp, m in [0.5, 1)
    min_exp = 1 - bias  # exponent of the smallest normal number
    e = torch.clamp(exp - 1, min=min_exp)
    step = torch.ldexp(torch.ones_like(a), e - mbits)
    q = torch.round(a / step) * step  # exact scaling by powers of two; ties to even
    _, qexp = torch.frexp(q)
    normal = q >= 2.0**min_exp
    biased = torch.where(normal, qexp - 1 + bias, torch.zeros_like(qexp))
    mant_step = torch.ldexp(torch.ones_like(q), torch.where(normal, qexp - 1, min_exp) - mbits)
    mant = torch.round(q / mant_step).to(torch.int32) - torch.where(normal, 1 << mbits, 0)
    code = (biased.to(torch.int32) << mbits) | mant | (sign.to(torch.int32) << 7)
    return code.to(torch.uint8)


def _hfp8_decode_torch(q: torch.Tensor, ebits: int, bias: int) -> torch.Tensor:
    mbits = 7 - ebits
    c = q.to(torch.int32)
    e = (c >> mbits) & ((1 << ebits) - 1)
    m = (c & ((1 << mbits) - 1)).float()
    normal = e > 0
    mag = torch.where(
        normal,
        torch.ldexp(1 + m / (1 << mbits), (e - bias).float()),
        torch.ldexp(m, torch.full_like(m, 1 - bias - mbits)),
    )
    return torch.where((c >> 7).bool(), -mag, mag)


def hfp8_encode(x: torch.Tensor, ebits: int, bias: int, max_pos: float) -> torch.Tensor:
    """uint8 hfp8 codes of ``x`` (same shape)."""
    if fbgemm_available() and x.device.type == "cpu" and x.numel() > 0:
        flat = x.detach().float().contiguous().view(1, -1)
        out = torch.ops.fbgemm.FloatToHFP8Quantized(flat, ebits, bias, max_pos)
        return out.view(x.shape)
    return _hfp8_encode_torch(x, ebits, bias, max_pos)


def hfp8_decode(q: torch.Tensor, ebits: int, bias: int) -> torch.Tensor:
    """float32 values of uint8 hfp8 codes (same shape)."""
    q = q.contiguous().view(torch.uint8)
    if fbgemm_available() and q.device.type == "cpu" and q.numel() > 0:
        flat = q.view(1, -1)
        return torch.ops.fbgemm.HFP8QuantizedToFloat(flat, ebits, bias).view(q.shape)
    return _hfp8_decode_torch(q, ebits, bias)


# -- FP8 row-wise ----------------------------------------------------------------------------------


def _pack_rows(codes: torch.Tensor, *row_floats: torch.Tensor) -> torch.Tensor:
    rows, dim = codes.shape
    out = torch.zeros(rows, aligned_row_bytes(dim), dtype=torch.uint8, device=codes.device)
    out[:, :dim] = codes
    floats = torch.stack([f.float() for f in row_floats], dim=1).contiguous()
    tail = out.shape[1] - 8
    out[:, tail : tail + 4 * len(row_floats)] = floats.view(torch.uint8).view(rows, -1)
    return out


def _row_floats(q: torch.Tensor, count: int) -> tuple[torch.Tensor, int]:
    tail = q.shape[1] - 8
    floats = q[:, tail : tail + 4 * count].contiguous().view(torch.float32)
    return floats, tail


def fp8_rowwise_encode(x2d: torch.Tensor, forward: bool = True) -> torch.Tensor:
    """Rows of ``x2d`` (rows, D) -> uint8 (rows, aligned_row_bytes(D))."""
    ebits, bias, max_pos = HFP8_FWD if forward else HFP8_BWD
    x2d = x2d.float()
    absmax = torch.fmax(x2d.amax(dim=1), -x2d.amin(dim=1)) if x2d.shape[1] else x2d.new_zeros(x2d.shape[0])
    scale = max_pos / (absmax + _FP8_EPS)
    codes = hfp8_encode(x2d * scale[:, None], ebits, bias, max_pos)
    return _pack_rows(codes, scale)


def fp8_rowwise_decode(q2d: torch.Tensor, row_dim: int, forward: bool = True) -> torch.Tensor:
    """uint8 (rows, aligned_row_bytes(row_dim)) -> float32 (rows, row_dim)."""
    ebits, bias, _ = HFP8_FWD if forward else HFP8_BWD
    floats, _ = _row_floats(q2d, 1)
    return hfp8_decode(q2d[:, :row_dim], ebits, bias) / floats[:, :1]


# -- INT8 row-wise -------------------------------------------------------------------------------


def int8_rowwise_encode(x2d: torch.Tensor) -> torch.Tensor:
    """Rows of ``x2d`` (rows, D) -> uint8 (rows, aligned_row_bytes(D)): codes, scale, bias."""
    x2d = x2d.detach().float().contiguous()
    rows, dim = x2d.shape
    if fbgemm_available() and x2d.device.type == "cpu" and dim % 4 == 0 and rows > 0:
        return torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(x2d)
    lo = x2d.amin(dim=1) if dim else x2d.new_zeros(rows)
    hi = x2d.amax(dim=1) if dim else x2d.new_zeros(rows)
    value_range = hi - lo
    inverse = 255.0 / (value_range + _INT8_EPS)
    # FBGEMM's vectorised CPU kernel rounds its intermediate differently: about 1 code in 10^5,
    # sitting within float32 rounding of a .5 tie, comes out one step apart.
    codes = torch.round((x2d - lo[:, None]) * inverse[:, None]).clamp(0, 255).to(torch.uint8)
    return _pack_rows(codes, value_range / 255.0, lo)


def int8_rowwise_decode(q2d: torch.Tensor, row_dim: int) -> torch.Tensor:
    """uint8 (rows, aligned_row_bytes(row_dim)) -> float32 (rows, row_dim)."""
    q2d = q2d.contiguous()
    if fbgemm_available() and q2d.device.type == "cpu" and row_dim % 4 == 0 and q2d.shape[0] > 0:
        return torch.ops.fbgemm.Fused8BitRowwiseQuantizedToFloat(q2d)
    floats, _ = _row_floats(q2d, 2)
    scale, bias = floats[:, :1].double(), floats[:, 1:2].double()
    return (q2d[:, :row_dim].double() * scale + bias).float()  # one rounding, as FBGEMM's FMA


# -- MX4 -----------------------------------------------------------------------------------------


def _mx4_reference():  # noqa: ANN202 (fbgemm's module)
    if not fbgemm_available():
        raise RuntimeError(
            "MX4 comm precision needs fbgemm_gpu's MX4 reference implementation, which is not "
            "available here; use FP8, INT8, BF16 or FP16."
        )
    from fbgemm_gpu.triton import quantize_ref

    return quantize_ref


def mx4_encode(x: torch.Tensor, group_size: int, rounding_mode: object = None) -> torch.Tensor:
    """MX4 (FBGEMM's packed layout: ``n / 2`` bytes of 4-bit values, one shared exponent per
    group); the last dimension is padded to whole groups first."""
    ref = _mx4_reference()
    if rounding_mode is None:
        from fbgemm_gpu.triton.common import RoundingMode

        rounding_mode = RoundingMode.even
    return ref.py_quantize_mx4(x.float(), group_size, rounding_mode=rounding_mode).view(-1)


def mx4_decode(q: torch.Tensor, group_size: int) -> torch.Tensor:
    return _mx4_reference().py_dequantize_mx4(q, group_size).float()
