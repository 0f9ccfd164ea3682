"""The distillation divergences, each defined once (its per-entry terms and their derivative), and
the divergence over a threshold-found Top-N selection with its detached custom backward.

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

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from mtpd_jax.shifts import shift_left
from mtpd_jax.top_n import above

_OFF = 1e30  # subtracted from unselected logits in the threshold form (absorbs the logit in f32)


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


# ---------------------------------------------------------------------------------------------
# Over a threshold selection (losses.py's `threshold` Top-N form)


def log_normalizer(x_BxTxV):
  """logsumexp over V as (m, log Σ exp(x - m)), m the stop-gradient max; log-probabilities are
  then (x - m) - log Σ, exact to f32 rounding of x - m even where |x| is large."""
  m_BxT = lax.stop_gradient(jnp.max(x_BxTxV, axis=-1))
  return m_BxT, jnp.log(jnp.sum(jnp.exp(x_BxTxV - m_BxT[..., None]), axis=-1))


def _log_probs(x_BxTxV, lse):
  return (x_BxTxV - lse[0][..., None]) - lse[1][..., None]


def selection_mask(teacher_BxTxV, threshold_BxT, student_BxTxV=None, student_threshold_BxT=None):
  """1.0 on the selected entries (teacher > its threshold, ∪ student > its threshold), else 0.0."""
  sel = above(lax.stop_gradient(teacher_BxTxV) - threshold_BxT[..., None])
  if student_threshold_BxT is not None:
    sel_s = above(lax.stop_gradient(student_BxTxV) - student_threshold_BxT[..., None])
    sel = sel + sel_s - sel * sel_s  # a union counts each index once
  return sel


def deselect(x_BxTxV, sel_BxTxV):
  """x on the selection and -1e30 off it (arithmetic, not a select, so XLA:CPU keeps it fused):
  a softmax of the result is exactly 0 off the selection."""
  return x_BxTxV + (sel_BxTxV - 1.0) * _OFF


def teacher_log_normalizer(t_BxTxV, threshold_BxT, renormalize: bool):
  """`log_normalizer` of the teacher over its own selection (over V if not `renormalize`): in
  'teacher' mode it is the same for every head, so it is computed once per row."""
  if not renormalize:
    return log_normalizer(t_BxTxV)
  return log_normalizer(deselect(t_BxTxV, selection_mask(t_BxTxV, threshold_BxT)))


def masked_log_probs(t_BxTxV, s_BxTxV, sel_BxTxV, renormalize, t_lse_BxT=None, s_lse_BxT=None):
  """Teacher and student log-probabilities, over the selection or (renormalize=False) over V."""
  if renormalize:
    t_BxTxV, s_BxTxV = deselect(t_BxTxV, sel_BxTxV), deselect(s_BxTxV, sel_BxTxV)
  t_lse_BxT = log_normalizer(t_BxTxV) if t_lse_BxT is None else t_lse_BxT
  s_lse_BxT = log_normalizer(s_BxTxV) if s_lse_BxT is None else s_lse_BxT
  return _log_probs(t_BxTxV, t_lse_BxT), _log_probs(s_BxTxV, s_lse_BxT), t_lse_BxT, s_lse_BxT


def masked_divergence(t_BxTxV, s_BxTxV, sel_BxTxV, *, measure, renormalize, t_lse_BxT=None):
  """The divergence over the entries where sel = 1, from f32 logits already divided by τ.

  renormalize: both softmaxes over the selection; else full-vocabulary softmaxes, with the terms
  summed over the selection. `t_lse_BxT`: the teacher's log-normaliser, if precomputed.
  """
  logq, logp, _, _ = masked_log_probs(t_BxTxV, s_BxTxV, sel_BxTxV, renormalize, t_lse_BxT)
  terms_BxTxV = terms(logq, logp, measure)
  return jnp.sum(terms_BxTxV if renormalize else terms_BxTxV * sel_BxTxV, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def detached_divergence(t_BxTxV, s_BxTxV, thr_BxT, s_thr_BxT, t_lse_BxT, shift, measure, renormalize):
  """`masked_divergence` over a threshold selection, differentiated only in the student.

  The teacher (its logits, threshold and log-normaliser) is read `shift` rows on: head k at row
  i against the main head at row i+k. The gradient is an elementwise expression of the logits
  and per-row scalars, recomputed in the backward pass, so no [.., V] residual is stored.
  """
  return detached_divergence_fwd(t_BxTxV, s_BxTxV, thr_BxT, s_thr_BxT, t_lse_BxT, shift, measure,
                                 renormalize)[0]


def _aligned(t_BxTxV, s_BxTxV, thr_BxT, s_thr_BxT, t_lse_BxT, shift, renormalize, s_lse_R=None):
  """The shifted teacher's selection and both log-probabilities, as rows R = B·T aligned with the
  student's rows: XLA:CPU's vectorised reductions need whole 2-D arrays (an offset slice, or a
  leading dimension of 1, falls back to a scalar loop, far slower than a copy; docs/design.md)."""
  t_BxTxV = shift_left(t_BxTxV, shift)
  thr_BxT = shift_left(thr_BxT, shift, fill=-jnp.inf)  # rows past the end: select everything
  t_lse_BxT = jax.tree.map(lambda x: shift_left(x, shift), t_lse_BxT)
  rows = lambda x: jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), x)
  sel_RxV = selection_mask(rows(t_BxTxV), rows(thr_BxT), rows(s_BxTxV), rows(s_thr_BxT))
  logq, logp, _, s_lse_R = masked_log_probs(rows(t_BxTxV), rows(s_BxTxV), sel_RxV, renormalize,
                                             rows(t_lse_BxT), s_lse_R)
  return sel_RxV, logq, logp, s_lse_R


def detached_divergence_fwd(t_BxTxV, s_BxTxV, thr_BxT, s_thr_BxT, t_lse_BxT, shift, measure, renormalize):
  sel_RxV, logq, logp, s_lse_R = _aligned(t_BxTxV, s_BxTxV, thr_BxT, s_thr_BxT, t_lse_BxT, shift,
                                          renormalize)
  terms_RxV = terms(logq, logp, measure)
  div_R = jnp.sum(terms_RxV if renormalize else terms_RxV * sel_RxV, axis=-1)
  return div_R.reshape(s_BxTxV.shape[:-1]), (t_BxTxV, s_BxTxV, thr_BxT, s_thr_BxT, t_lse_BxT, s_lse_R)


def detached_divergence_bwd(shift, measure, renormalize, res, g_BxT):
  """The student's gradient from the measure's one definition (divergences.student_gradient); the
  teacher's inputs get zeros: this, not a stop_gradient, is what detaches the teacher."""
  t_BxTxV, s_BxTxV, thr_BxT, s_thr_BxT, t_lse_BxT, s_lse_R = res
  sel_RxV, logq, logp, _ = _aligned(t_BxTxV, s_BxTxV, thr_BxT, s_thr_BxT, t_lse_BxT, shift,
                                    renormalize, s_lse_R)
  sel = 1.0 if renormalize else sel_RxV  # renormalised: p and q are already 0 off the selection
  ds_RxV = g_BxT.reshape(-1, 1) * student_gradient(logq, logp, sel, measure)
  zero = lambda x: jax.tree.map(jnp.zeros_like, x)
  return zero(t_BxTxV), ds_RxV.reshape(s_BxTxV.shape), zero(thr_BxT), zero(s_thr_BxT), zero(t_lse_BxT)


detached_divergence.defvjp(detached_divergence_fwd, detached_divergence_bwd)
