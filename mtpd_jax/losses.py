"""MTP-D losses (the paper's total loss; docs/design.md, "Data flow"): main CE + Σ_k α_k·CE_k + Σ_k β_k·KL_k, as pure functions of arrays.

The distillation term is the paper's KL (Eq. 5) by default; `LossConfig.divergence` swaps in total
variation or Jensen-Shannon over the same selection (docs/design.md, "Divergences"). Internally a
"measure" names the per-entry terms: 'forward' or 'reverse' (the KL's direction), 'tv' or 'js'.

Dimension letters: the legend in mtpd_jax/__init__.py.

Alignment: head k at position i predicts token i+k+1, the same token as the main head at i+k,
so the teacher of head k at i is the main logits at i+k (Fig. 1). All softmaxes run in f32.

Top-N selection (Figs. 6 and 10) comes in two forms. `top_k` gathers the indices of `lax.top_k`, a
sort on CPU that cost more than the whole KL. `threshold` finds, per row, a value c with
count(logits > c) = N by a search of count reductions over V, and computes the KL over all of V
with the unselected logits at -1e30: no sort and no gather, and every reduction over V shards
over a vocab-sharded mesh axis (only per-row scalars cross devices). Its set equals top_k's when
the logits are distinct; logits tied with the N-th largest are all selected.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from mtpd_jax import divergences
from mtpd_jax.shifts import shift_left
from mtpd_jax.top_n import top_n_threshold

KL_DIRECTIONS = ('forward', 'reverse')
DIVERGENCES = ('kl', 'tv', 'js')
MEASURES = KL_DIRECTIONS + DIVERGENCES[1:]
TOP_N_MODES = ('teacher', 'union')
TEACHERS = ('main', 'ensemble_mean')
SELECTIONS = ('top_k', 'threshold')
_MASKED = -1e9  # logit of an unselected entry: exp underflows to 0, differences stay finite


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Every setting of the MTP-D loss (docs/design.md, "Data flow"), checked once when built.

  ce_weight: λ; each head's CE weight is α_k = λ/K. beta: β_k, one value per head. distill: False
  gives the plain "MTP" baseline (CE only, no KL computed). top_n: N, or None for the whole
  vocabulary. top_n_mode ('teacher' or 'union'), renormalize, kl ('forward' or 'reverse'), tau,
  detach, teacher ('main' or 'ensemble_mean'): the paper's ablation knobs (Tables 2 and 6), see
  `top_n_indices`, `distill_divergence`, `ensemble_teacher`. selection: how Top-N is found:
  'threshold' (`top_n_threshold`, a mask; ties at the N-th value are all selected) or 'top_k'
  (`lax.top_k` indices, gathered). divergence: 'kl' (the paper's), 'tv' (total variation) or 'js'
  (Jensen-Shannon); TV and JS are symmetric, so `kl` must stay 'forward' with them. The metric
  `distill/k{k}/kl` holds whichever divergence is chosen.
  """
  ce_weight: float = 0.3
  beta: tuple[float, ...] = (1.0,)
  distill: bool = True
  top_n: int | None = None
  top_n_mode: str = 'teacher'
  renormalize: bool = True
  kl: str = 'forward'
  tau: float = 1.0
  detach: bool = True
  teacher: str = 'main'
  selection: str = 'threshold'
  divergence: str = 'kl'

  def __post_init__(self):
    object.__setattr__(self, 'beta', tuple(float(b) for b in self.beta))
    for name, choices in (('teacher', TEACHERS), ('top_n_mode', TOP_N_MODES), ('selection', SELECTIONS),
                          ('kl', KL_DIRECTIONS), ('divergence', DIVERGENCES)):
      if getattr(self, name) not in choices:
        raise ValueError(f'unknown {name} {getattr(self, name)!r}; expected one of {choices}')
    if self.divergence != 'kl' and self.kl != 'forward':
      raise ValueError(f'kl={self.kl!r} is a direction of the KL; divergence={self.divergence!r} is '
                       "symmetric: leave kl='forward'")
    if self.top_n is not None and self.top_n < 1:
      raise ValueError(f'top_n={self.top_n}: expected a positive count or None (the whole vocabulary)')
    if not self.tau > 0:
      raise ValueError(f'tau={self.tau}: expected a positive temperature')

  @property
  def measure(self) -> str:
    """The per-entry terms of the distillation loss: the KL's direction, or 'tv' / 'js'."""
    return self.kl if self.divergence == 'kl' else self.divergence

  def check_heads(self, num_mtp_heads: int) -> None:
    if len(self.beta) != num_mtp_heads:
      raise ValueError(f'beta has {len(self.beta)} values for {num_mtp_heads} MTP heads')


@jax.custom_vjp
def materialize_grad(x):
  """Identity whose cotangent is written to memory before it flows back (on CPU; a no-op elsewhere).

  XLA:CPU otherwise fuses the whole loss gradient into the transposing copy that feeds the
  unembedding's weight-gradient matmul, evaluating it in column order, much slower than the
  loss gradient plus a plain transpose (docs/design.md). A conditional is the one boundary it never fuses across
  (an optimization barrier is dropped before fusion on CPU).
  """
  return x


def _materialize_grad_bwd(_, g):
  if jax.default_backend() != 'cpu':
    return (g,)
  leaves, treedef = jax.tree.flatten(g)
  finite = jnp.isfinite(leaves[0].ravel()[0])  # unknown before run time, so the branch stays
  out = lax.cond(finite, lambda ls: ls, lambda ls: [x * 1.0 for x in ls], leaves)
  return (jax.tree.unflatten(treedef, out),)


materialize_grad.defvjp(lambda x: (x, None), _materialize_grad_bwd)


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
  0 marks padding. Packed documents never leak into each other's targets. Comparing the two ends
  suffices because ids never decrease along a row (data.pack_window numbers documents by a running
  count of EOS tokens), so equal ends mean no boundary in between.
  """
  tgt_seg_BxT = shift_left(target_segment_ids_BxT, k, fill=0)
  return (tgt_seg_BxT == segment_ids_BxT) & (segment_ids_BxT > 0)


def top_n_indices(teacher_BxTxV, student_BxTxV, top_n: int, mode: str):
  """Indices S of the Top-N selection and a mask of the distinct ones (Table 2's "10000x2"; docs/design.md, "Choices").

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


# ---------------------------------------------------------------------------------------------
# The divergence and the full loss


def distill_divergence(teacher_BxTxV, student_BxTxV, idx_BxTxN=None, valid_BxTxN=None, *,
                       measure: str = 'forward', renormalize: bool = True, tau: float = 1.0,
                       threshold_BxT=None, student_threshold_BxT=None):
  """Per-position divergence between teacher and student, over the selected indices (all of V if none).

  measure: 'forward' = KL(teacher ‖ student) (mass-covering, the paper's default), 'reverse' =
  KL(student ‖ teacher), 'tv' = total variation, 'js' = Jensen-Shannon (divergences.py). The selection is either gathered indices (`idx`, `valid` from `top_n_indices`) or a threshold
  (teacher > `threshold_BxT`, joined with student > `student_threshold_BxT` if given; see
  `top_n_threshold`). renormalize: both softmaxes run over the selected logits only (Fig. 6;
  default); otherwise full-vocabulary log-probabilities, with the sum of terms restricted to S.
  """
  t_BxTxV = teacher_BxTxV.astype(jnp.float32) / tau
  s_BxTxV = student_BxTxV.astype(jnp.float32) / tau
  if threshold_BxT is not None:
    sel_BxTxV = divergences.selection_mask(teacher_BxTxV, threshold_BxT, student_BxTxV, student_threshold_BxT)
    return divergences.masked_divergence(t_BxTxV, s_BxTxV, sel_BxTxV, measure=measure, renormalize=renormalize)
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
  terms = divergences.terms(logq, logp, measure)
  return jnp.sum(jnp.where(valid, terms, 0.0), axis=-1)


def ensemble_teacher(logits_BxTxV, mtp_logits_KxBxTxV, k: int):
  """Log of the mean distribution of every earlier predictor of head k's target (Table 6's ensemble mean).

  For head k at position i the target is token i+k+1; it is also predicted by the main head at
  i+k and by head j < k at position i+k-j. Returns f32 log-probabilities, usable as logits.
  """
  members = [shift_left(logits_BxTxV, k)] + [shift_left(mtp_logits_KxBxTxV[j - 1], k - j)
                                               for j in range(1, k)]
  logp_MembersxBxTxV = jnp.stack([jax.nn.log_softmax(m.astype(jnp.float32), -1) for m in members])
  return jax.nn.logsumexp(logp_MembersxBxTxV, axis=0) - jnp.log(float(len(members)))


def _threshold_divergences(logits_BxTxV, mtp_logits_KxBxTxV, heads, *, top_n, top_n_mode, measure,
                           renormalize, tau, detach, teacher):
  """Per head k, the threshold-selected divergence at each position ([B, T]; junk at the last k positions).

  With the main head as teacher, its selection (and, in `teacher` mode, its log-normaliser over
  the selection) is computed once per row; head k reads it k rows on.
  """
  # With detach, what detaches the teacher is `_detached_divergence`'s custom VJP (a zero cotangent
  # for every teacher input; the detach test holds it to that). The stop_gradients here and below
  # only spare autodiff a backward path that would carry those zeros to the logits.
  main_t_BxTxV = (lax.stop_gradient(logits_BxTxV) if detach else logits_BxTxV).astype(jnp.float32) / tau
  if teacher == 'main':
    main_thr_BxT = top_n_threshold(main_t_BxTxV, top_n)
    main_lse_BxT = None
    if top_n_mode == 'teacher':
      main_lse_BxT = divergences.teacher_log_normalizer(main_t_BxTxV, main_thr_BxT, renormalize)
  divs = []
  for k, student_BxTxV in enumerate(heads, start=1):
    s_BxTxV = student_BxTxV.astype(jnp.float32) / tau
    s_thr_BxT = top_n_threshold(s_BxTxV, top_n) if top_n_mode == 'union' else None
    if teacher == 'main':  # head k at row i against the main head at row i+k
      t_BxTxV, thr_BxT, lse_BxT, shift = main_t_BxTxV, main_thr_BxT, main_lse_BxT, k
    else:
      t_BxTxV = ensemble_teacher(logits_BxTxV, mtp_logits_KxBxTxV, k) / tau
      t_BxTxV = lax.stop_gradient(t_BxTxV) if detach else t_BxTxV
      thr_BxT, lse_BxT, shift = top_n_threshold(t_BxTxV, top_n), None, 0
    if detach:
      divs.append(divergences.detached_divergence(t_BxTxV, s_BxTxV, thr_BxT, s_thr_BxT, lse_BxT, shift, measure,
                                      renormalize))
    else:
      t_BxTxV, thr_BxT = shift_left(t_BxTxV, shift), shift_left(thr_BxT, shift, fill=-jnp.inf)
      lse_BxT = jax.tree.map(lambda x: shift_left(x, shift), lse_BxT)
      divs.append(divergences.masked_divergence(t_BxTxV, s_BxTxV, divergences.selection_mask(t_BxTxV, thr_BxT, s_BxTxV, s_thr_BxT),
                                    measure=measure, renormalize=renormalize, t_lse_BxT=lse_BxT))
  return divs


def mtp_d_loss(logits_BxTxV, mtp_logits_KxBxTxV, targets_BxT, segment_ids_BxT, target_segment_ids_BxT,
               cfg: LossConfig = LossConfig(), *, beta_scale=1.0):
  """The MTP-D training loss and its per-head metrics: the readable statement of the total loss.

  Args:
    logits_BxTxV: main-head logits; position i predicts targets[i].
    mtp_logits_KxBxTxV: head k (index k-1) at position i predicts targets[i+k].
    targets_BxT: inputs shifted left by one (token i+1 at position i).
    segment_ids_BxT, target_segment_ids_BxT: document ids of inputs and targets; 0 = padding.
    cfg: the loss's settings (`LossConfig`).
    beta_scale: multiplies every β_k (the KL warm-up).
  Returns:
    (loss, metrics) with metrics keyed `loss`, `xent`, `mtp/k{k}/xent`, `distill/k{k}/kl`,
    `mtp/k{k}/agree` (teacher-forced: the main head's argmax at i+k is an argmax of head k at i;
    one argmax per row instead of K+1, which cost 5% of a vocab-32k step).
  """
  num_mtp_heads = mtp_logits_KxBxTxV.shape[0]
  cfg.check_heads(num_mtp_heads)
  ce_weight, beta, distill, top_n, detach, teacher = (cfg.ce_weight, cfg.beta, cfg.distill, cfg.top_n,
                                                      cfg.detach, cfg.teacher)
  logits_BxTxV, mtp_logits_KxBxTxV = materialize_grad((logits_BxTxV, mtp_logits_KxBxTxV))
  # Split, not index: the cotangents of the heads are then concatenated, where indexing would
  # add K zero-padded [K, B, T, V] arrays, which XLA:CPU re-reads K times.
  heads = [h[0] for h in jnp.split(mtp_logits_KxBxTxV, num_mtp_heads)] if num_mtp_heads else []
  main_mask_BxT = target_mask(segment_ids_BxT, target_segment_ids_BxT, 0)
  main_xent = masked_mean(xent(logits_BxTxV, targets_BxT), main_mask_BxT)
  metrics = {'xent': main_xent}
  loss = main_xent
  teacher_logits_BxTxV = jax.lax.stop_gradient(logits_BxTxV) if detach else logits_BxTxV
  main_argmax_BxT = jnp.argmax(logits_BxTxV, axis=-1)
  # The main-head Top-N of each row is shared by every head (head k reads it shifted by k).
  shared_idx, threshold_divs = None, None
  if distill and top_n is not None and cfg.selection == 'threshold':
    threshold_divs = _threshold_divergences(logits_BxTxV, mtp_logits_KxBxTxV, heads, top_n=top_n,
                                           top_n_mode=cfg.top_n_mode, measure=cfg.measure,
                                           renormalize=cfg.renormalize, tau=cfg.tau, detach=detach, teacher=teacher)
  elif distill and top_n is not None and teacher == 'main' and cfg.top_n_mode == 'teacher':
    shared_idx = top_n_indices(teacher_logits_BxTxV, None, top_n, 'teacher')
  for k in range(1, num_mtp_heads + 1):
    student_BxTxV = heads[k - 1]
    mask_BxT = target_mask(segment_ids_BxT, target_segment_ids_BxT, k)
    ce_k = masked_mean(xent(student_BxTxV, shift_left(targets_BxT, k)), mask_BxT)
    loss += ce_weight / num_mtp_heads * ce_k
    metrics[f'mtp/k{k}/xent'] = ce_k
    idx_BxTx1 = shift_left(main_argmax_BxT, k)[..., None]
    at_main_argmax_BxT = jnp.take_along_axis(student_BxTxV, idx_BxTx1, axis=-1)[..., 0]
    agree_BxT = at_main_argmax_BxT >= jnp.max(student_BxTxV, axis=-1)
    metrics[f'mtp/k{k}/agree'] = masked_mean(agree_BxT, mask_BxT)
    if not distill:
      continue
    if threshold_divs is not None:
      kl_BxT = threshold_divs[k - 1]
    else:
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
        idx, valid = top_n_indices(t_BxTxV, student_BxTxV, top_n, cfg.top_n_mode)
      kl_BxT = distill_divergence(t_BxTxV, student_BxTxV, idx, valid, measure=cfg.measure,
                                  renormalize=cfg.renormalize, tau=cfg.tau)
    kl_k = masked_mean(kl_BxT, mask_BxT)
    loss += beta_scale * beta[k - 1] * kl_k
    metrics[f'distill/k{k}/kl'] = kl_k
  metrics['loss'] = loss
  return loss, metrics
