"""Rotary position embedding frequencies: default, linear and YaRN, as HF computes them.

    angle(t, i) = t * inv_freq[i]                  t: absolute position, i < head_dim / 2
    rope(x)     = [x1 cos - x2 sin, x2 cos + x1 sin] * attention_factor   (NeoX halves)

    default  inv_freq[i] = theta ** (-2i / D)
    linear   inv_freq[i] = theta ** (-2i / D) / factor
    yarn     inv_freq[i] = interp[i] * (1 - e[i]) + extrap[i] * e[i]
               extrap = theta ** (-2i / D), interp = extrap / factor,
               e = 1 - clamp((i - low) / (high - low), 0, 1) over the correction range
               [low, high] of (beta_fast, beta_slow) rotations at original_max_position_embeddings;
             attention_factor = 0.1 * ln(factor) + 1 (or mscale / mscale_all_dim's ratio, or
               the config's own), multiplying cos and sin, so q.k picks up its square.

Every step is float32, in HF's order (transformers 4.5x `_compute_*_parameters`
and 5.x alike), so the tables match HF's to the last bit or two. Positions
are never rescaled: the paged kernels, windows and page tables see the same
absolute positions with or without scaling; only the K written into the
pages (rotated, and scaled by attention_factor under YaRN) differs, so an fp8
layer's k_scale must be calibrated on the scaled K.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

ROPE_TYPES = ("default", "linear", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A `rope_scaling` (transformers 4) / `rope_parameters` (5) entry, resolved.

    Attributes:
      rope_type: "linear" | "yarn".
      factor: the context extension factor (> 0).
      original_max_position_embeddings: yarn: the pretraining context length.
      attention_factor: yarn: cos / sin multiplier; None derives it from factor
        (and mscale / mscale_all_dim when both are set), as HF does.
      beta_fast, beta_slow: yarn: correction range in rotations (HF: 32, 1).
      truncate: yarn: floor / ceil the correction range (HF: true).
    """
    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ("linear", "yarn"):
            raise ValueError(f"RopeScaling rope_type={self.rope_type!r}; implemented: linear, yarn")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling factor={self.factor} must be > 0")
        if self.rope_type == "yarn" and not self.original_max_position_embeddings:
            raise ValueError("yarn RopeScaling needs original_max_position_embeddings")

    def to_hf(self) -> dict:
        """The transformers-4 `rope_scaling` dict (transformers 5 reads it too)."""
        out = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "yarn":
            out.update(original_max_position_embeddings=self.original_max_position_embeddings,
                       beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                       truncate=self.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return float(_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim))
    return _yarn_mscale(s.factor)


@functools.lru_cache(maxsize=64)
def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
    """(inv_freq f32[head_dim // 2], attention_factor) for one config."""
    dim = head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(theta), exponent, dtype=np.float32)   # theta ** (2i / D)
    if scaling is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    if scaling.rope_type == "linear":
        inv_freq = np.float32(1.0) / pos_freqs
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32), 1.0
    # yarn
    factor = scaling.factor
    original = scaling.original_max_position_embeddings

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    extrapolation_factor = np.float32(1.0) - np.clip(ramp, 0, 1).astype(np.float32)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = (interpolation * (np.float32(1.0) - extrapolation_factor)
                + extrapolation * extrapolation_factor)
    return inv_freq.astype(np.float32), yarn_attention_factor(scaling)
