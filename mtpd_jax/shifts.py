"""Aligning position i with position i ± k along the sequence axis (axis 1), and reading or writing
each sequence at its own positions.

Head k at position i predicts token i+k+1, the main head's target at i+k (Fig. 1), so the loss,
the model's head inputs and the decoder all read arrays k positions on or back; a decoding batch
holds sequences of different lengths, so the decoder reads and writes each at its own positions.
"""

from typing import Any

import jax.numpy as jnp


def shift_left(x_BxT, k: int, fill: Any = 0):
  """x[:, i + k] at position i; the last k positions get `fill`."""
  if k == 0:
    return x_BxT
  pad = jnp.full((x_BxT.shape[0], k) + x_BxT.shape[2:], fill, x_BxT.dtype)
  return jnp.concatenate([x_BxT[:, k:], pad], axis=1)


def shift_right(x_BxT, k: int, fill: Any = 0):
  """x[:, i - k] at position i; the first k positions get `fill`."""
  if k == 0:
    return x_BxT
  pad = jnp.full((x_BxT.shape[0], k) + x_BxT.shape[2:], fill, x_BxT.dtype)
  return jnp.concatenate([pad, x_BxT[:, :-k]], axis=1)


def gather_at(x_BxS, pos_BxWindow):
  """x[b, pos[b, w]] along axis 1: each sequence read at its own positions (past the end: the last)."""
  idx = jnp.clip(pos_BxWindow, 0, x_BxS.shape[1] - 1)
  idx = idx.reshape(pos_BxWindow.shape + (1,) * (x_BxS.ndim - 2))
  return jnp.take_along_axis(x_BxS, idx, axis=1)


def write_at(x_BxS, pos_BxWindow, val_BxWindow, keep_BxWindow=None):
  """x[b, pos[b, w]] = val[b, w] where `keep`; other and out-of-range writes are dropped."""
  if keep_BxWindow is not None:
    pos_BxWindow = jnp.where(keep_BxWindow, pos_BxWindow, x_BxS.shape[1])
  return x_BxS.at[jnp.arange(x_BxS.shape[0])[:, None], pos_BxWindow].set(val_BxWindow, mode='drop')
