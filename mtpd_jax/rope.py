"""Rotary position embedding, with Llama-3's long-context frequency scaling (Hugging Face checkpoints)."""

import math

import jax.numpy as jnp


def frequencies(head_dim: int, base: float, scaling: tuple[float, ...] = ()):
  """[E/2] inverse frequencies base^(-2j/E); `scaling` = (factor, low_freq_factor, high_freq_factor,
  original context) rescales them as Llama 3.1 does: wavelengths above the original context over
  low_freq_factor are divided by `factor`, those below it over high_freq_factor are kept, and the
  band between is interpolated (Hugging Face's 'llama3' rope type)."""
  inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if not scaling:
    return inv_freq
  factor, low, high, context = scaling
  wavelen = 2 * math.pi / inv_freq
  smooth = (context / wavelen - low) / (high - low)
  scaled = jnp.where(wavelen > context / low, inv_freq / factor, inv_freq)
  between = (wavelen <= context / low) & (wavelen >= context / high)
  return jnp.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def rope(x_BxTxHxE, positions_BxT, base: float, interleaved: bool, scaling: tuple[float, ...] = ()):
  """Rotary embedding; `interleaved` rotates pairs (2j, 2j+1), else pairs (j, j + E/2)."""
  angle_BxTx1xE2 = positions_BxT[..., None, None].astype(jnp.float32) * frequencies(x_BxTxHxE.shape[-1], base,
                                                                                     scaling)
  sin, cos = jnp.sin(angle_BxTx1xE2), jnp.cos(angle_BxTx1xE2)
  x = x_BxTxHxE.astype(jnp.float32)
  if interleaved:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
  else:
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxE.dtype)
