"""The MTP-D loss from hidden states, in row chunks: no [K+1, B, T, V] logits ever exist.

`losses.mtp_d_loss` takes the logits of the main head and of every MTP head, so a train step
holds K+1 [B, T, V] arrays plus their gradients: with V = 32k that, not the model, sets the
step's memory. Here the final-normed hidden states and the unembedding come in instead, and the
loss walks over chunks of rows; each chunk computes its logits, its loss terms and, at once,
their gradients with respect to the chunk's hidden states and the unembedding (the fused
linear-cross-entropy technique: no logits are stored and none are recomputed).

Alignment: head k at position i predicts token i+k+1 = targets[i+k], as does the main head at
i+k, its teacher. Shifting head k's hidden states right by k puts every predictor of targets[j]
on row j, so a chunk of rows holds each KL pair whole.

Supported (see `supports`): plain MTP, and MTP-D with teacher='main', detach=True and
selection='threshold' (the defaults) with any top_n (or None), top_n_mode, renormalize, kl,
divergence and tau. Any other setting is refused (the harness refuses it when it reads the config). Metrics are
not differentiable. In 'teacher' mode all heads take one set of whole-array passes against one
teacher distribution per chunk (`_shared_teacher_kl`); 'union' mode goes head by head
(`_per_head_kl`). Both read the divergence's one definition (divergences.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from mtpd_jax import divergences, losses
from mtpd_jax.shifts import shift_right
from mtpd_jax.top_n import top_n_threshold


def _chunk(x_K1xRxD, w_DxV, targets_R, mask_K1xR, ce_coef_K1, kl_coef_K, cfg):
  """Loss sums of one chunk of rows and their gradients w.r.t. its hidden states and w."""
  top_n, top_n_mode, measure, renormalize, tau, distill, w_grad, main_grad = cfg
  z_K1xRxV = jnp.einsum('krd,dv->krv', x_K1xRxD, w_DxV.astype(x_K1xRxD.dtype),
                        preferred_element_type=jnp.float32)
  num_pred, rows, v = z_K1xRxV.shape
  onehot_RxV = (lax.broadcasted_iota(jnp.int32, (rows, v), 1) == targets_R[:, None]).astype(jnp.float32)
  m_K1xR = jnp.max(z_K1xRxV, axis=-1)
  e_K1xRxV = jnp.exp(z_K1xRxV - m_K1xR[..., None])
  sum_K1xR = jnp.sum(e_K1xRxV, axis=-1)
  ce_K1xR = (m_K1xR + jnp.log(sum_K1xR)) - jnp.sum(z_K1xRxV * onehot_RxV, axis=-1)
  # d CE / d z = softmax - onehot, weighted by each row's share of its predictor's mean.
  g_ce_K1xR = ce_coef_K1[:, None] * mask_K1xR
  dz_K1xRxV = g_ce_K1xR[..., None] * (e_K1xRxV / sum_K1xR[..., None] - onehot_RxV)
  # Agreement: the main head's argmax is an argmax of head k (one argmax per row, not K+1).
  main_argmax_K1xRx1 = jnp.broadcast_to(jnp.argmax(z_K1xRxV[0], axis=-1)[None, :, None], (num_pred, rows, 1))
  at_main_argmax_K1xR = jnp.take_along_axis(z_K1xRxV, main_argmax_K1xRx1, axis=-1)[..., 0]
  sums = {'ce': jnp.sum(ce_K1xR * mask_K1xR, axis=-1),
          'agree': jnp.sum((at_main_argmax_K1xR >= m_K1xR) * mask_K1xR, axis=-1)}
  if distill and num_pred > 1:
    t_1xRxV = z_K1xRxV[:1] / tau
    thr_1xR = (top_n_threshold(t_1xRxV, top_n) if top_n is not None
               else jnp.full((1, rows), -jnp.inf))
    g_K1xR = jnp.concatenate([jnp.zeros(1), kl_coef_K])[:, None] * mask_K1xR  # the main row has no KL
    args = (z_K1xRxV, thr_1xR, g_K1xR, top_n, top_n_mode, measure, renormalize, tau)
    if top_n_mode == 'teacher':  # one selection for every head
      kl_K1xR, ds_K1xRxV = _shared_teacher_kl(z_K1xRxV, thr_1xR, g_K1xR, measure, renormalize, tau)
    else:
      kl_K1xR, ds_K1xRxV = _per_head_kl(*args)
    dz_K1xRxV = dz_K1xRxV + ds_K1xRxV
    sums['kl'] = jnp.sum(kl_K1xR[1:] * mask_K1xR[1:], axis=-1)
  # A frozen trunk (and final norm) takes no gradient from the main head's row, and a frozen
  # unembedding none at all: those products are skipped, not computed and dropped.
  first = 0 if main_grad else 1
  dz = dz_K1xRxV[first:].astype(x_K1xRxD.dtype)
  dx_K1xRxD = jnp.einsum('krv,dv->krd', dz, w_DxV.astype(dz.dtype), preferred_element_type=jnp.float32)
  dx_K1xRxD = jnp.concatenate([jnp.zeros_like(dx_K1xRxD[:first]), dx_K1xRxD])
  if w_grad:
    dw_DxV = jnp.einsum('rd,rv->dv', x_K1xRxD[first:].reshape(-1, x_K1xRxD.shape[-1]), dz.reshape(-1, v),
                        preferred_element_type=jnp.float32)
  else:
    dw_DxV = jnp.zeros(w_DxV.shape, jnp.float32)
  return sums, dx_K1xRxD.astype(x_K1xRxD.dtype), dw_DxV


def _per_head_kl(z_K1xRxV, thr_1xR, g_K1xR, top_n, top_n_mode, measure, renormalize, tau):
  """Each head's divergence against the main row (row 0) and its gradient w.r.t. the logits, one
  head at a time through `divergences.detached_divergence_fwd`/`_bwd`: any mode, direction and
  divergence. Row 0's are zeros."""
  rows, v = z_K1xRxV.shape[1:]
  t_1xRxV = z_K1xRxV[:1] / tau
  # In 'teacher' mode the teacher's log-normaliser over S is shared by every head.
  t_lse = divergences.teacher_log_normalizer(t_1xRxV, thr_1xR, renormalize) if top_n_mode == 'teacher' else None
  kls, ds = [jnp.zeros(rows, jnp.float32)], [jnp.zeros((1, rows, v), jnp.float32)]
  for k in range(1, z_K1xRxV.shape[0]):
    s_1xRxV = z_K1xRxV[k:k + 1] / tau
    s_thr_1xR = top_n_threshold(s_1xRxV, top_n) if top_n_mode == 'union' and top_n is not None else None
    kl_1xR, res = divergences.detached_divergence_fwd(t_1xRxV, s_1xRxV, thr_1xR, s_thr_1xR, t_lse, 0, measure,
                                                 renormalize)
    ds.append(divergences.detached_divergence_bwd(0, measure, renormalize, res, g_K1xR[k:k + 1])[1] / tau)
    kls.append(kl_1xR[0])
  return jnp.stack(kls), jnp.concatenate(ds)


def _shared_teacher_kl(z_K1xRxV, thr_1xR, g_K1xR, measure, renormalize, tau):
  """`_per_head_kl` in 'teacher' mode, in a few whole-array passes for all heads: the teacher's
  selection S and log-probabilities are computed once per chunk, and every head's divergence and
  gradient come from the measure's one definition (divergences.py). Equal to `_per_head_kl` to f32
  rounding. Row 0 (the main head) has g = 0, so its gradient is 0."""
  t_RxV = z_K1xRxV[0] / tau
  sel_RxV = divergences.selection_mask(t_RxV, thr_1xR[0])
  t_lse = divergences.teacher_log_normalizer(t_RxV, thr_1xR[0], renormalize)
  logq, logp, _, _ = divergences.masked_log_probs(t_RxV[None], z_K1xRxV / tau, sel_RxV[None], renormalize,
                                             jax.tree.map(lambda x: x[None], t_lse))
  terms_K1xRxV = divergences.terms(logq, logp, measure)
  sel = 1.0 if renormalize else sel_RxV[None]
  kl_K1xR = jnp.sum(terms_K1xRxV * sel, axis=-1)
  ds_K1xRxV = g_K1xR[..., None] * divergences.student_gradient(logq, logp, sel, measure)
  return kl_K1xR, ds_K1xRxV / tau


def _fused_fwd(x_K1xRxD, w_DxV, targets_R, mask_K1xR, ce_coef_K1, kl_coef_K, cfg, chunk_rows):
  num_pred, r, d = x_K1xRxD.shape
  y = r // chunk_rows
  xs = (x_K1xRxD.reshape(num_pred, y, chunk_rows, d).swapaxes(0, 1), targets_R.reshape(y, chunk_rows),
        mask_K1xR.reshape(num_pred, y, chunk_rows).swapaxes(0, 1))

  def body(dw_DxV, xs_c):
    sums, dx, dw = _chunk(*xs_c[:1], w_DxV, *xs_c[1:], ce_coef_K1, kl_coef_K, cfg)
    return dw_DxV + dw, (sums, dx)
  dw_DxV, (sums, dx_GroupsxK1xRxD) = lax.scan(body, jnp.zeros(w_DxV.shape, jnp.float32), xs)
  sums = jax.tree.map(lambda s: jnp.sum(s, axis=0), sums)
  loss = jnp.sum(ce_coef_K1 * sums['ce']) + (jnp.sum(kl_coef_K * sums['kl']) if 'kl' in sums else 0.0)
  dx_K1xRxD = dx_GroupsxK1xRxD.swapaxes(0, 1).reshape(num_pred, r, d)
  return (loss, sums), (dx_K1xRxD, dw_DxV.astype(w_DxV.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _fused(x_K1xRxD, w_DxV, targets_R, mask_K1xR, ce_coef_K1, kl_coef_K, cfg, chunk_rows):
  return _fused_fwd(x_K1xRxD, w_DxV, targets_R, mask_K1xR, ce_coef_K1, kl_coef_K, cfg, chunk_rows)[0]


def _fused_bwd(cfg, chunk_rows, res, cts):
  dx_K1xRxD, dw_DxV = res
  g = cts[0]  # the loss's cotangent; metric sums are not differentiated
  return g * dx_K1xRxD, g * dw_DxV, None, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def supports(cfg: losses.LossConfig) -> bool:
  """Whether `mtp_d_loss_fused` implements `cfg` (the harness refuses a fused loss that does not)."""
  return not cfg.distill or (cfg.teacher == 'main' and cfg.detach and cfg.selection == 'threshold')


def mtp_d_loss_fused(hidden_K1xBxTxD, w_DxV, targets_BxT, segment_ids_BxT, target_segment_ids_BxT,
                     cfg: losses.LossConfig = losses.LossConfig(), *, beta_scale=1.0, chunk_rows: int = 256,
                     w_grad: bool = True, main_grad: bool = True):
  """`losses.mtp_d_loss` of the logits hidden @ w, without materialising them (same metrics).

  Args:
    hidden_K1xBxTxD: final-normed hidden states of the main head (index 0) and heads 1..K.
    w_DxV: the shared unembedding (the model's `unembed`, or `embed.T` when tied).
    cfg, beta_scale: as `losses.mtp_d_loss`; `supports(cfg)` must hold.
    chunk_rows: rows (of B·T) per chunk: memory ∝ (K+1)·chunk_rows·V, and fewer, larger chunks
      run closer to matmul speed.
    w_grad: False when `w_DxV` is frozen: its gradient (one product as large as the logits') is
      not computed and comes back as zeros.
    main_grad: False when nothing below the main head's hidden state trains (a frozen trunk and
      final norm): the main head's row gets no gradient (zeros), only the heads' rows do.
  """
  if not supports(cfg):
    raise ValueError('the fused loss supports teacher=main, detach=True, selection=threshold; got '
                     f'teacher={cfg.teacher!r}, detach={cfg.detach}, selection={cfg.selection!r}: '
                     'set train.loss_chunk_rows=0 for the loss on full logits')
  num_mtp_heads = hidden_K1xBxTxD.shape[0] - 1
  cfg.check_heads(num_mtp_heads)
  b, t, d = hidden_K1xBxTxD.shape[1:]
  # Row j of predictor k: head k at position j-k, which predicts targets[j] like the main head at j.
  predictors = range(num_mtp_heads + 1)
  x_K1xBxTxD = jnp.stack([shift_right(hidden_K1xBxTxD[k], k) for k in predictors])
  mask_K1xBxT = jnp.stack([shift_right(losses.target_mask(segment_ids_BxT, target_segment_ids_BxT, k), k,
                                        fill=False) for k in predictors]).astype(jnp.float32)
  count_K1 = jnp.maximum(jnp.sum(mask_K1xBxT, axis=(1, 2)), 1.0)
  alpha_K = jnp.full(num_mtp_heads, cfg.ce_weight / max(num_mtp_heads, 1))  # α_k = λ/K
  ce_coef_K1 = jnp.concatenate([jnp.ones(1), alpha_K]) / count_K1
  kl_coef_K = beta_scale * jnp.asarray(cfg.beta, jnp.float32) / count_K1[1:]
  rows = b * t
  chunk_rows = min(chunk_rows, rows)
  pad = -rows % chunk_rows
  x_K1xRxD = jnp.pad(x_K1xBxTxD.reshape(num_mtp_heads + 1, rows, d), ((0, 0), (0, pad), (0, 0)))
  targets_R = jnp.pad(targets_BxT.reshape(rows), (0, pad))
  mask_K1xR = jnp.pad(mask_K1xBxT.reshape(num_mtp_heads + 1, rows), ((0, 0), (0, pad)))
  static = (cfg.top_n, cfg.top_n_mode, cfg.measure, cfg.renormalize, cfg.tau, cfg.distill, w_grad, main_grad)
  loss, sums = _fused(x_K1xRxD, w_DxV, targets_R, mask_K1xR, ce_coef_K1, kl_coef_K, static, chunk_rows)
  sums = lax.stop_gradient(sums)
  metrics = {'xent': sums['ce'][0] / count_K1[0], 'loss': loss}
  for k in range(1, num_mtp_heads + 1):
    metrics[f'mtp/k{k}/xent'] = sums['ce'][k] / count_K1[k]
    metrics[f'mtp/k{k}/agree'] = sums['agree'][k] / count_K1[k]
    if cfg.distill:
      metrics[f'distill/k{k}/kl'] = sums['kl'][k - 1] / count_K1[k]
  return loss, metrics
