"""The distillation divergences, each defined once: its per-entry terms and their derivative.

Dimension letters: the legend in mtpd_jax/__init__.py. Over the entries of a selection S (the
teacher's Top-N, or all of V), with logq the teacher's and logp the student's log-probabilities
(docs/design.md, "Divergences"):

  forward   KL(q ‖ p)  the paper's (Eq. 5)        term q (log q - log p)              ∂/∂log p  -q
  reverse   KL(p ‖ q)                              term p (log p - log q)              ∂/∂log p  p (log p - log q + 1)
  tv        total variation ½ Σ |q - p|            term ½ |q - p|                      ∂/∂log p  ½ p sign(p - q)
  js        Jensen-Shannon, m = (q + p) / 2        term ½ q log(q/m) + ½ p log(p/m)    ∂/∂log p  ½ p log(p/m)

Every path reads this table: the reference loss (`losses.distill_divergence`, differentiated by
autodiff), the threshold path's custom backward and the fused loss. Those two take the student's
gradient from `student_gradient`: with p the student's softmax (over S when renormalised, else over
V) and g the derivative above, d/ds_j Σ_{i∈S} term_i = [j ∈ S] g_j - p_j Σ_{i∈S} g_i. A new
measure is one entry here, one row of the gradient test and one config comment.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp


class Divergence(NamedTuple):
  terms: Callable  # (logq, logp) -> per-entry terms, 0 where q or p is 0
  grad: Callable   # (logq, logp) -> the terms' derivative in logp


def _logm(logq, logp):
  return jnp.logaddexp(logq, logp) - jnp.log(2.0)  # in log space, so 0·log 0 never forms


TABLE = {
    'forward': Divergence(lambda logq, logp: jnp.exp(logq) * (logq - logp),
                          lambda logq, logp: -jnp.exp(logq)),
    'reverse': Divergence(lambda logq, logp: jnp.exp(logp) * (logp - logq),
                          lambda logq, logp: jnp.exp(logp) * (logp - logq + 1.0)),
    'tv': Divergence(lambda logq, logp: 0.5 * jnp.abs(jnp.exp(logq) - jnp.exp(logp)),
                     lambda logq, logp: 0.5 * jnp.exp(logp) * jnp.sign(jnp.exp(logp) - jnp.exp(logq))),
    'js': Divergence(lambda logq, logp: 0.5 * (jnp.exp(logq) * (logq - _logm(logq, logp))
                                              + jnp.exp(logp) * (logp - _logm(logq, logp))),
                     lambda logq, logp: 0.5 * jnp.exp(logp) * (logp - _logm(logq, logp))),
}


def _measure(measure: str) -> Divergence:
  if measure not in TABLE:
    raise ValueError(f'unknown divergence measure {measure!r}; expected one of {tuple(TABLE)}')
  return TABLE[measure]


def terms(logq, logp, measure: str):
  """Per-entry terms of `measure` (a name in TABLE) from the two log-probabilities."""
  return _measure(measure).terms(logq, logp)


def student_gradient(logq, logp, sel, measure: str):
  """d/ds of Σ over the selection of the terms, per entry of the student's logits s (over the last
  axis): sel·g - p·Σ sel·g. `sel` is 1.0 on S (a mask, or 1.0 when renormalised: then p and q are
  already 0 off S)."""
  g_V = _measure(measure).grad(logq, logp) * sel
  return g_V - jnp.exp(logp) * jnp.sum(g_V, axis=-1, keepdims=True)
