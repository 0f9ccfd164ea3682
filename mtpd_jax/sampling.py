"""Token choice from logits: the temperature/top-p transform, sampling, and speculative verification.

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


def verify(key, drafts_BxJ, draft_logits_BxJxV, logits_BxJ1xV, temperature: float, top_p: float = 1.0,
           num_drafts_B=None):
  """Accepted-prefix length a_B and the token that follows the accepted drafts.

  `logits_BxJ1xV[:, j]` is the main head after the pending token and drafts 1..j, so it is the
  target distribution of draft j+1 (and, at j = J, of the bonus token). Greedy: draft j is
  accepted iff it equals the main argmax, and the next token is the main argmax after the accepted
  prefix. Sampling (Leviathan et al. 2023; Chen et al. 2023): draft j ~ q_j is accepted with
  probability min(1, p_j/q_j); at the first rejection the next token is drawn from the
  normalised residual max(0, p - q), and after J acceptances from p_{J+1}; the emitted tokens
  then follow the main head's sampling distribution exactly.

  `num_drafts_B` (adaptive depth): only drafts 1..n were proposed; the rest are rejected and have
  q = 0, so after n acceptances the next token is drawn from p_{n+1} itself, as after J.
  """
  b, j = drafts_BxJ.shape
  proposed_BxJ = True if num_drafts_B is None else jnp.arange(j) < num_drafts_B[:, None]
  if temperature == 0.0:
    target_BxJ1 = jnp.argmax(logits_BxJ1xV, axis=-1).astype(jnp.int32)
    ok_BxJ = (drafts_BxJ == target_BxJ1[:, :j]) & proposed_BxJ
    a_B = jnp.sum(jnp.cumprod(ok_BxJ, axis=1), axis=1).astype(jnp.int32)
    return a_B, jnp.take_along_axis(target_BxJ1, a_B[:, None], axis=1)[:, 0]
  key_u, key_next = jax.random.split(key)
  p_BxJ1xV = probs(logits_BxJ1xV, temperature, top_p)
  q_BxJxV = probs(draft_logits_BxJxV, temperature, top_p)
  if num_drafts_B is not None:
    q_BxJxV = jnp.where(proposed_BxJ[..., None], q_BxJxV, 0.0)
  p_draft_BxJ = jnp.take_along_axis(p_BxJ1xV[:, :j], drafts_BxJ[..., None], axis=-1)[..., 0]
  q_draft_BxJ = jnp.take_along_axis(q_BxJxV, drafts_BxJ[..., None], axis=-1)[..., 0]
  ok_BxJ = accept_draft(jax.random.uniform(key_u, (b, j)), p_draft_BxJ, q_draft_BxJ) & proposed_BxJ
  a_B = jnp.sum(jnp.cumprod(ok_BxJ, axis=1), axis=1).astype(jnp.int32)
  # q after the last draft is zero, so the "residual" after J acceptances is p_{J+1} itself.
  q_BxJ1xV = jnp.concatenate([q_BxJxV, jnp.zeros_like(q_BxJxV[:, :1])], axis=1)
  p_BxV = jnp.take_along_axis(p_BxJ1xV, a_B[:, None, None], axis=1)[:, 0]
  q_BxV = jnp.take_along_axis(q_BxJ1xV, a_B[:, None, None], axis=1)[:, 0]
  return a_B, categorical(key_next, residual(p_BxV, q_BxV))
