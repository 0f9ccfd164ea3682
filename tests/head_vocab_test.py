"""Heads over a head vocabulary: the loss and its gradients are the full-vocabulary loss with every
logit outside U at -inf, and targets outside U are masked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpd_jax import head_vocab, losses
from mtpd_jax.shifts import shift_left

from conftest import distinct_logits

V, D, K = 40, 16, 2
IDS = np.array([31, 2, 17, 5, 0, 23, 11, 8, 38, 14, 26, 20], np.int32)  # U = 12, in no particular order
OUT = -1e9  # "-inf" outside U: softmax gives exactly 0 there, and no nan forms


def _inputs():
  b, t = 2, 10
  x_K1xBxTxD = distinct_logits(40, (K + 1, b, t, D), scale=4.0)
  w_DxV = distinct_logits(41, (D, V), scale=3.0)
  targets = jax.random.randint(jax.random.key(42), (b, t), 0, V)
  targets = targets.at[0, :5].set(jnp.asarray(IDS[:5]))  # some targets inside U, most outside
  seg = jnp.ones((b, t), jnp.int32).at[1, 6:].set(2)
  tseg = jnp.ones((b, t), jnp.int32).at[1, 5:].set(2)
  return x_K1xBxTxD, w_DxV, targets, seg, tseg


def _reference(x_KxBxTxD, w_DxV, main_BxTxV, targets, seg, tseg, cfg):
  """losses' full-vocabulary pieces on logits that are OUT off U; targets outside U are masked."""
  inside_V = jnp.zeros((V,), bool).at[IDS].set(True)
  restrict = lambda z: jnp.where(inside_V, z, OUT)
  teacher_BxTxV = restrict(jax.lax.stop_gradient(main_BxTxV))
  loss, n = 0.0, min(cfg.top_n or len(IDS), len(IDS))
  for k in range(1, K + 1):
    s_BxTxV = restrict(jnp.einsum('btd,dv->btv', x_KxBxTxD[k - 1], w_DxV))
    mask = losses.target_mask(seg, tseg, k)
    tgt = shift_left(targets, k)
    loss += cfg.ce_weight / K * losses.masked_mean(losses.xent(s_BxTxV, tgt), mask & inside_V[tgt])
    if cfg.distill:
      t_BxTxV = shift_left(teacher_BxTxV, k)
      idx, valid = losses.top_n_indices(t_BxTxV, None, n, 'teacher')
      div = losses.distill_divergence(t_BxTxV, s_BxTxV, idx, valid, measure=cfg.measure,
                                      renormalize=cfg.renormalize, tau=cfg.tau)
      loss += cfg.beta[k - 1] * losses.masked_mean(div, mask)
  return loss


@pytest.mark.parametrize('kw', [
    dict(top_n=5), dict(top_n=5, renormalize=False), dict(top_n=5, kl='reverse', tau=2.0), dict(top_n=None),
    dict(top_n=7, divergence='tv'), dict(top_n=7, divergence='js', renormalize=False, tau=0.7),
    dict(top_n=5, distill=False)])
def test_head_vocabulary_loss_and_gradients_equal_the_full_loss_with_logits_outside_at_minus_inf(kw):
  x_K1xBxTxD, w_DxV, targets, seg, tseg = _inputs()
  cfg = losses.LossConfig(beta=(0.5, 0.25), **kw)
  main_BxTxV = jnp.einsum('btd,dv->btv', x_K1xBxTxD[0], w_DxV)

  def ours(x_KxBxTxD, w_DxV):
    t = head_vocab.teacher(main_BxTxV, targets, IDS, n=cfg.top_n, tau=cfg.tau)
    return head_vocab.mtp_loss(x_KxBxTxD, w_DxV[:, IDS], t, targets, seg, tseg, IDS, V, cfg)[0]
  ref = lambda x, w: _reference(x, w, main_BxTxV, targets, seg, tseg, cfg)
  got, (gx, gw) = jax.value_and_grad(ours, argnums=(0, 1))(x_K1xBxTxD[1:], w_DxV)
  want, (wx, ww) = jax.value_and_grad(ref, argnums=(0, 1))(x_K1xBxTxD[1:], w_DxV)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(gx, wx, rtol=1e-4, atol=1e-6 * float(jnp.abs(wx).max()))
  np.testing.assert_allclose(gw, ww, rtol=1e-4, atol=1e-6 * float(jnp.abs(ww).max()))
  assert float(jnp.abs(gw[:, np.setdiff1d(np.arange(V), IDS)]).max()) == 0.0  # columns outside U: untouched


def test_targets_outside_the_head_vocabulary_are_masked_and_the_metrics_read_token_ids():
  x_K1xBxTxD, w_DxV, targets, seg, tseg = _inputs()
  cfg = losses.LossConfig(beta=(0.5, 0.25), top_n=5)
  main_BxTxV = jnp.einsum('btd,dv->btv', x_K1xBxTxD[0], w_DxV)
  t = head_vocab.teacher(main_BxTxV, targets, IDS, n=5)
  _, m = head_vocab.mtp_loss(x_K1xBxTxD[1:], w_DxV[:, IDS], t, targets, seg, tseg, IDS, V, cfg)
  # Head 1's CE: only positions whose target (token i+2) is in U and in the window count.
  s_BxTxU = jnp.einsum('btd,du->btu', x_K1xBxTxD[1], w_DxV[:, IDS])
  mask = np.asarray(losses.target_mask(seg, tseg, 1))
  pos = [(b, i) for b in range(2) for i in range(9) if mask[b, i] and int(targets[b, i + 1]) in IDS]
  assert (0, 1) in pos and len(pos) < mask.sum()  # targets[0, 1..4] are IDS[1..4]; others lie outside U
  want = np.mean([-jax.nn.log_softmax(s_BxTxU[b, i])[list(IDS).index(int(targets[b, i + 1]))] for b, i in pos])
  np.testing.assert_allclose(m['mtp/k1/xent'], want, rtol=1e-5)
  # Agreement: head 1's argmax over U, as a token id, against the main argmax over V at i+1.
  draft = IDS[np.argmax(s_BxTxU, -1)]
  main = np.argmax(main_BxTxV, -1)
  np.testing.assert_allclose(m['mtp/k1/agree'], (draft[:, :-1] == main[:, 1:])[mask[:, :-1]].mean(), rtol=1e-6)
  np.testing.assert_array_equal(t.argmax_BxT, main)
  np.testing.assert_allclose(t.target_logp_BxT, -losses.xent(main_BxTxV, targets), rtol=1e-6)


def test_a_head_vocabulary_that_cannot_be_one_is_refused():
  for bad in ([], [0, 0], [-1], [V], [[1, 2]], [0.5]):
    with pytest.raises(ValueError, match='head vocabulary'):
      head_vocab.check_ids(np.asarray(bad), V)
  x_K1xBxTxD, w_DxV, targets, seg, tseg = _inputs()
  t = head_vocab.teacher(jnp.einsum('btd,dv->btv', x_K1xBxTxD[0], w_DxV), targets, IDS, n=5)
  with pytest.raises(ValueError, match="teacher='main', top_n_mode='teacher', detach=True"):
    head_vocab.mtp_loss(x_K1xBxTxD[1:], w_DxV[:, IDS], t, targets, seg, tseg, IDS, V,
                        losses.LossConfig(beta=(0.5, 0.5), top_n=5, top_n_mode='union'))
