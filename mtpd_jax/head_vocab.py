"""MTP heads trained over a head vocabulary: U token ids, the most frequent of the training text.

Decoding drafts only among a draft vocabulary's ids (drafting.DraftVocab), so a head needs no more
output than those U columns of the shared unembedding: head k's logits are final_norm(h^k) @
W[:, ids_U], and its cross-entropy and distillation are taken over U (docs/design.md, "Head
vocabulary"). The main head keeps all of V: it verifies, so decoding stays lossless.

- A target outside U is masked out of head k's cross-entropy: a draft can never be it.
- The teacher is the main head restricted to U: its Top-N among the U logits (N = distill.top_n,
  capped at U; None = all of U) and their log-probabilities under the softmax over U at τ. With
  renormalize (the default), both sides are renormalised over those N entries, as the
  full-vocabulary loss renormalises over its Top-N. So the loss is exactly the full-vocabulary
  loss with every logit outside U at -inf, on both sides (tests/head_vocab_test.py).
- The agreement metric compares head k's argmax over U, as a token id, with the main head's
  argmax over all of V: a position whose main argmax lies outside U counts as disagreeing, as it
  would be rejected in decoding.

`Teacher` holds what the loss reads of the main head; `teacher` computes it from the main logits,
and the harness's teacher cache stores it once per training position for a frozen trunk.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtpd_jax import divergences, losses
from mtpd_jax.shifts import shift_left


class Teacher(NamedTuple):
  """What the head-vocabulary loss reads of the (detached) main head, per position."""
  idx_BxTxN: jax.Array          # int32: the main head's Top-N among the U columns, as indices into U
  logp_BxTxN: jax.Array         # f32: their log-probabilities under softmax(main logits over U / τ)
  argmax_BxT: jax.Array         # int32: the main head's argmax over all of V (a token id)
  target_logp_BxT: jax.Array    # f32: the main head's log-probability of its target, over all of V

  @classmethod
  def from_batch(cls, batch: dict) -> 'Teacher':
    return cls(*(batch[f'teacher_{name}'] for name in BATCH_FIELDS))


# The batch keys of a cached teacher: `teacher_idx`, `teacher_logp`, `teacher_argmax`, `teacher_target_logp`.
BATCH_FIELDS = ('idx', 'logp', 'argmax', 'target_logp')


def top_n(num_ids: int, n: int | None) -> int:
  """The teacher's selection size over a head vocabulary of `num_ids`: N capped at U (None: all of U)."""
  return num_ids if n is None else min(int(n), num_ids)


def teacher(logits_BxTxV, targets_BxT, ids_U, *, n: int | None, tau: float = 1.0) -> Teacher:
  """The `Teacher` of main-head logits over V (detached here)."""
  logits_BxTxV = jax.lax.stop_gradient(logits_BxTxV).astype(jnp.float32)
  z_BxTxU = jnp.take(logits_BxTxV, jnp.asarray(ids_U), axis=-1)
  idx_BxTxN = jax.lax.top_k(z_BxTxU, top_n(z_BxTxU.shape[-1], n))[1]
  logp_BxTxU = jax.nn.log_softmax(z_BxTxU / tau, axis=-1)
  return Teacher(idx_BxTxN.astype(jnp.int32), jnp.take_along_axis(logp_BxTxU, idx_BxTxN, axis=-1),
                 jnp.argmax(logits_BxTxV, axis=-1).astype(jnp.int32), -losses.xent(logits_BxTxV, targets_BxT))


def index_of(ids_U, vocab_size: int) -> jax.Array:
  """[V] int32: each token id's index in the head vocabulary, -1 outside it."""
  return jnp.full((vocab_size,), -1, jnp.int32).at[jnp.asarray(ids_U)].set(jnp.arange(len(ids_U), dtype=jnp.int32))


def check_ids(ids_U, vocab_size: int) -> np.ndarray:
  """Head-vocabulary ids as int32, distinct and in [0, V); anything else raises ValueError."""
  ids = np.asarray(ids_U)
  if ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f'a head vocabulary is a non-empty 1-D array of token ids, got shape {ids.shape} {ids.dtype}')
  if ids.min() < 0 or ids.max() >= vocab_size or len(np.unique(ids)) != len(ids):
    raise ValueError(f'head vocabulary ids must be distinct and in [0, {vocab_size})')
  return ids.astype(np.int32)


def mtp_loss(x_KxBxTxD, w_DxU, teacher: Teacher, targets_BxT, segment_ids_BxT, target_segment_ids_BxT,
             ids_U, vocab_size: int, cfg: losses.LossConfig, *, beta_scale=1.0):
  """Σ_k α_k·CE_k + β_k·D_k of K heads over the head vocabulary, and their metrics.

  x_KxBxTxD: final-normed hidden states of heads 1..K; w_DxU: the unembedding's U columns.
  The main head's own cross-entropy is not included (the caller adds it); metrics are keyed as
  `losses.mtp_d_loss` keys them (`mtp/k{k}/xent`, `mtp/k{k}/agree`, `distill/k{k}/kl`).
  """
  num_mtp_heads = x_KxBxTxD.shape[0]
  cfg.check_heads(num_mtp_heads)
  if cfg.distill and (cfg.teacher != 'main' or cfg.top_n_mode != 'teacher' or not cfg.detach):
    raise ValueError('heads over a head vocabulary distil from the detached main head\'s own Top-N '
                     f"(teacher='main', top_n_mode='teacher', detach=True); got teacher={cfg.teacher!r}, "
                     f'top_n_mode={cfg.top_n_mode!r}, detach={cfg.detach}')
  ids_U = jnp.asarray(ids_U)
  target_idx_BxT = jnp.take(index_of(ids_U, vocab_size), targets_BxT)
  loss, metrics = 0.0, {}
  for k in range(1, num_mtp_heads + 1):
    s_BxTxU = jnp.einsum('btd,du->btu', x_KxBxTxD[k - 1], w_DxU, preferred_element_type=jnp.float32)
    mask_BxT = losses.target_mask(segment_ids_BxT, target_segment_ids_BxT, k)
    tgt_BxT = shift_left(target_idx_BxT, k, fill=-1)
    in_vocab_BxT = mask_BxT & (tgt_BxT >= 0)  # a target outside U is never a draft: masked
    ce_k = losses.masked_mean(losses.xent(s_BxTxU, jnp.maximum(tgt_BxT, 0)), in_vocab_BxT)
    loss += cfg.ce_weight / num_mtp_heads * ce_k
    metrics[f'mtp/k{k}/xent'] = ce_k
    draft_BxT = jnp.take(ids_U, jnp.argmax(s_BxTxU, axis=-1))
    metrics[f'mtp/k{k}/agree'] = losses.masked_mean(draft_BxT == shift_left(teacher.argmax_BxT, k), mask_BxT)
    if not cfg.distill:
      continue
    # Head k at i against the main head at i+k, over the main head's Top-N among U there.
    idx_BxTxN = shift_left(teacher.idx_BxTxN, k)
    logq_BxTxN = shift_left(teacher.logp_BxTxN, k)
    s_BxTxU = s_BxTxU / cfg.tau
    if cfg.renormalize:
      logq_BxTxN = jax.nn.log_softmax(logq_BxTxN, axis=-1)
      logp_BxTxN = jax.nn.log_softmax(jnp.take_along_axis(s_BxTxU, idx_BxTxN, axis=-1), axis=-1)
    else:
      logp_BxTxN = jnp.take_along_axis(jax.nn.log_softmax(s_BxTxU, axis=-1), idx_BxTxN, axis=-1)
    div_BxT = jnp.sum(divergences.terms(logq_BxTxN, logp_BxTxN, cfg.measure), axis=-1)
    kl_k = losses.masked_mean(div_BxT, mask_BxT)
    loss += beta_scale * cfg.beta[k - 1] * kl_k
    metrics[f'distill/k{k}/kl'] = kl_k
  return loss, metrics
