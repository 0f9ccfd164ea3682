"""Aligning position i with position i ± k along the sequence axis (axis 1).

Head k at position i predicts token i+k+1, the main head's target at i+k (Fig. 1), so the loss,
the model's head inputs and the decoder all read arrays k positions on or back.
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
