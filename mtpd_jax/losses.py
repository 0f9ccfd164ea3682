"""MTP-D losses (SPEC §2.7): main CE + Σ_k α_k·CE_k + Σ_k β_k·KL_k, as pure functions of arrays.

Dimension legend: B batch, T positions, V vocab, K MTP heads, N Top-N selected logits.

Alignment: head k at position i predicts token i+k+1, the same token as the main head at i+k,
so the teacher of head k at i is the main logits at i+k (SPEC §2.2). All softmaxes run in f32.
"""

import jax
import jax.numpy as jnp

from mtpd_jax.model import shift_left

KL_DIRECTIONS = ('forward', 'reverse')
TOP_N_MODES = ('teacher', 'union')
TEACHERS = ('main', 'ensemble_mean')
_MASKED = -1e9  # logit of an unselected entry: exp underflows to 0, differences stay finite


def xent(logits_BxTxV, targets_BxT):
  """Per-position cross-entropy in f32."""
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]


def masked_mean(x_BxT, mask_BxT):
  mask_BxT = mask_BxT.astype(jnp.float32)
  return jnp.sum(x_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


def target_mask(segment_ids_BxT, target_segment_ids_BxT, k: int):
  """Positions i whose depth-k target (token i+k+1) is in the window and in token i's document.

  `segment_ids` label the inputs and `target_segment_ids` the targets (inputs shifted by one);
  0 marks padding. Packed documents never leak into each other's targets.
  """
  tgt_seg_BxT = shift_left(target_segment_ids_BxT, k, fill=0)
  return (tgt_seg_BxT == segment_ids_BxT) & (segment_ids_BxT > 0)


def top_n_indices(teacher_BxTxV, student_BxTxV, top_n: int, mode: str):
  """Indices S of the Top-N selection and a mask of the distinct ones (SPEC §2.3, §3 "10000x2").

  `teacher`: the teacher's top-N. `union`: the teacher's top-N joined with the student's top-N
  (2N slots; a student index already chosen by the teacher is masked out, not counted twice).
  """
  idx_BxTxN = jax.lax.top_k(jax.lax.stop_gradient(teacher_BxTxV), top_n)[1]
  valid_BxTxN = jnp.ones(idx_BxTxN.shape, bool)
  if mode == 'union':
    student_idx_BxTxN = jax.lax.top_k(jax.lax.stop_gradient(student_BxTxV), top_n)[1]
    dup_BxTxN = jnp.any(student_idx_BxTxN[..., :, None] == idx_BxTxN[..., None, :], axis=-1)
    idx_BxTxN = jnp.concatenate([idx_BxTxN, student_idx_BxTxN], axis=-1)
    valid_BxTxN = jnp.concatenate([valid_BxTxN, ~dup_BxTxN], axis=-1)
  return idx_BxTxN, valid_BxTxN


def kl_divergence(teacher_BxTxV, student_BxTxV, idx_BxTxN=None, valid_BxTxN=None, *,
                  direction: str = 'forward', renormalize: bool = True, tau: float = 1.0):
  """Per-position KL between teacher and student, over the selected indices (all of V if idx is None).

  forward = KL(teacher ‖ student) (mass-covering, the paper's default); reverse = KL(student ‖ teacher).
  renormalize: both softmaxes run over the selected logits only (SPEC §2.3, default); otherwise
  the full-vocabulary log-probabilities are gathered and the KL sum is restricted to S.
  """
  t_BxTxV = teacher_BxTxV.astype(jnp.float32) / tau
  s_BxTxV = student_BxTxV.astype(jnp.float32) / tau
  if idx_BxTxN is None:
    logq, logp = jax.nn.log_softmax(t_BxTxV, -1), jax.nn.log_softmax(s_BxTxV, -1)
    valid = jnp.ones(logq.shape, bool)
  else:
    valid = jnp.ones(idx_BxTxN.shape, bool) if valid_BxTxN is None else valid_BxTxN
    if renormalize:
      t_sel = jnp.take_along_axis(t_BxTxV, idx_BxTxN, axis=-1)
      s_sel = jnp.take_along_axis(s_BxTxV, idx_BxTxN, axis=-1)
      logq = jax.nn.log_softmax(jnp.where(valid, t_sel, _MASKED), -1)
      logp = jax.nn.log_softmax(jnp.where(valid, s_sel, _MASKED), -1)
    else:
      logq = jnp.take_along_axis(jax.nn.log_softmax(t_BxTxV, -1), idx_BxTxN, axis=-1)
      logp = jnp.take_along_axis(jax.nn.log_softmax(s_BxTxV, -1), idx_BxTxN, axis=-1)
  if direction == 'forward':
    terms = jnp.exp(logq) * (logq - logp)
  elif direction == 'reverse':
    terms = jnp.exp(logp) * (logp - logq)
  else:
    raise ValueError(f'unknown KL direction {direction!r}; expected one of {KL_DIRECTIONS}')
  return jnp.sum(jnp.where(valid, terms, 0.0), axis=-1)


def ensemble_teacher(logits_BxTxV, mtp_logits_KxBxTxV, k: int):
  """Log of the mean distribution of every earlier predictor of head k's target (SPEC §3).

  For head k at position i the target is token i+k+1; it is also predicted by the main head at
  i+k and by head j < k at position i+k-j. Returns f32 log-probabilities, usable as logits.
  """
  members = [shift_left(logits_BxTxV, k)] + [shift_left(mtp_logits_KxBxTxV[j - 1], k - j)
                                               for j in range(1, k)]
  logp_MxBxTxV = jnp.stack([jax.nn.log_softmax(m.astype(jnp.float32), -1) for m in members])
  return jax.nn.logsumexp(logp_MxBxTxV, axis=0) - jnp.log(float(len(members)))


def mtp_d_loss(logits_BxTxV, mtp_logits_KxBxTxV, targets_BxT, segment_ids_BxT, target_segment_ids_BxT,
               *, ce_weight: float = 0.3, beta=(1.0,), distill: bool = True, top_n: int | None = None,
               top_n_mode: str = 'teacher', renormalize: bool = True, kl: str = 'forward',
               tau: float = 1.0, detach: bool = True, teacher: str = 'main', beta_scale=1.0):
  """The MTP-D training loss and its per-head metrics.

  Args:
    logits_BxTxV: main-head logits; position i predicts targets[i].
    mtp_logits_KxBxTxV: head k (index k-1) at position i predicts targets[i+k].
    targets_BxT: inputs shifted left by one (token i+1 at position i).
    segment_ids_BxT, target_segment_ids_BxT: document ids of inputs and targets; 0 = padding.
    ce_weight: λ; each head's CE weight is α_k = λ/K.
    beta: β_k, one value per head. beta_scale multiplies all of them (KL warm-up).
    distill: False gives the plain "MTP" baseline (CE only, no KL computed).
    top_n: N, or None for the whole vocabulary. top_n_mode, renormalize, kl, tau, detach,
      teacher: the SPEC §2–3 knobs, see `top_n_indices`, `kl_divergence`, `ensemble_teacher`.
  Returns:
    (loss, metrics) with metrics keyed `loss`, `xent`, `mtp/k{k}/xent`, `distill/k{k}/kl`,
    `mtp/k{k}/agree` (teacher-forced: argmax of head k at i equals the main argmax at i+k).
  """
  num_heads = mtp_logits_KxBxTxV.shape[0]
  if len(beta) != num_heads:
    raise ValueError(f'beta has {len(beta)} values for {num_heads} MTP heads')
  if teacher not in TEACHERS:
    raise ValueError(f'unknown teacher {teacher!r}; expected one of {TEACHERS}')
  if top_n_mode not in TOP_N_MODES:
    raise ValueError(f'unknown top_n_mode {top_n_mode!r}; expected one of {TOP_N_MODES}')
  main_mask_BxT = target_mask(segment_ids_BxT, target_segment_ids_BxT, 0)
  main_xent = masked_mean(xent(logits_BxTxV, targets_BxT), main_mask_BxT)
  metrics = {'xent': main_xent}
  loss = main_xent
  teacher_logits_BxTxV = jax.lax.stop_gradient(logits_BxTxV) if detach else logits_BxTxV
  main_argmax_BxT = jnp.argmax(logits_BxTxV, axis=-1)
  # The main-head Top-N of each row is shared by every head (head k reads it shifted by k).
  shared_idx = None
  if distill and top_n is not None and teacher == 'main' and top_n_mode == 'teacher':
    shared_idx = top_n_indices(teacher_logits_BxTxV, None, top_n, 'teacher')
  for k in range(1, num_heads + 1):
    student_BxTxV = mtp_logits_KxBxTxV[k - 1]
    mask_BxT = target_mask(segment_ids_BxT, target_segment_ids_BxT, k)
    ce_k = masked_mean(xent(student_BxTxV, shift_left(targets_BxT, k)), mask_BxT)
    loss += ce_weight / num_heads * ce_k
    metrics[f'mtp/k{k}/xent'] = ce_k
    agree_BxT = jnp.argmax(student_BxTxV, axis=-1) == shift_left(main_argmax_BxT, k)
    metrics[f'mtp/k{k}/agree'] = masked_mean(agree_BxT, mask_BxT)
    if not distill:
      continue
    if teacher == 'main':
      t_BxTxV = shift_left(teacher_logits_BxTxV, k)
    else:
      t_BxTxV = ensemble_teacher(logits_BxTxV, mtp_logits_KxBxTxV, k)
      t_BxTxV = jax.lax.stop_gradient(t_BxTxV) if detach else t_BxTxV
    if top_n is None:
      idx, valid = None, None
    elif shared_idx is not None:
      idx, valid = shift_left(shared_idx[0], k), shift_left(shared_idx[1], k)
    else:
      idx, valid = top_n_indices(t_BxTxV, student_BxTxV, top_n, top_n_mode)
    kl_BxT = kl_divergence(t_BxTxV, student_BxTxV, idx, valid, direction=kl,
                           renormalize=renormalize, tau=tau)
    kl_k = masked_mean(kl_BxT, mask_BxT)
    loss += beta_scale * beta[k - 1] * kl_k
    metrics[f'distill/k{k}/kl'] = kl_k
  metrics['loss'] = loss
  return loss, metrics
