"""Token choice from logits: the temperature/top-p transform, sampling, and the speculative-sampling
test and residual that `verify.accept` verifies drafts with.

Pure array functions shared by plain and speculative decoding, so both draw from exactly the same
distribution. `temperature == 0` means greedy (argmax, first index on ties); it is a Python float,
static under jit. Dimension letters: the legend in mtpd_jax/__init__.py (`logits_V`: any leading
axes).
"""

import jax
import jax.numpy as jnp


def probs(logits_V, temperature: float, top_p: float = 1.0):
  """softmax(logits / temperature) restricted to the top-p nucleus and renormalised, in f32."""
  p_V = jax.nn.softmax(logits_V.astype(jnp.float32) / temperature, axis=-1)
  if top_p >= 1.0:
    return p_V
  order_V = jnp.argsort(-p_V, axis=-1, stable=True)
  sorted_V = jnp.take_along_axis(p_V, order_V, axis=-1)
  # Keep a token iff the mass strictly before it (in descending order) is < top_p: the smallest
  # prefix whose mass reaches top_p, and always at least the most likely token.
  keep_sorted_V = jnp.cumsum(sorted_V, axis=-1) - sorted_V < top_p
  keep_V = jnp.take_along_axis(keep_sorted_V, jnp.argsort(order_V, axis=-1), axis=-1)
  p_V = jnp.where(keep_V, p_V, 0.0)
  return p_V / jnp.sum(p_V, axis=-1, keepdims=True)


def choose(key, logits_BxV, temperature: float, top_p: float = 1.0):
  """One token per row: argmax when temperature == 0, else a sample from `probs`."""
  if temperature == 0.0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  return categorical(key, probs(logits_BxV, temperature, top_p))


def categorical(key, p_BxV):
  """One token per row, drawn from the (possibly unnormalised) probabilities p."""
  return jax.random.categorical(key, jnp.log(p_BxV), axis=-1).astype(jnp.int32)


def residual(p_BxV, q_BxV):
  """The normalised max(0, p - q): the law of the token at a rejected draft's position (p itself
  where p == q, which only rounding can make rejectable)."""
  r_BxV = jnp.maximum(p_BxV - q_BxV, 0.0)
  total_Bx1 = jnp.sum(r_BxV, axis=-1, keepdims=True)
  return jnp.where(total_Bx1 > 0, r_BxV / jnp.where(total_Bx1 > 0, total_Bx1, 1.0), p_BxV)


def accept_draft(u_BxJ, p_draft_BxJ, q_draft_BxJ):
  """Speculative-sampling test: accept a draft with probability min(1, p/q) (u ~ U[0, 1))."""
  return u_BxJ * q_draft_BxJ < p_draft_BxJ

