"""The MTP-D loss (the paper's total loss; docs/design.md): hand-computed cases, the threshold form
against gathered top_k, and a vocab-sharded loss that never gathers the vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpd_jax import losses, sharding
from conftest import distinct_logits, gathered_shapes, loss_inputs


def _np_kl(q_logits, p_logits):
  q = np.exp(q_logits - np.log(np.exp(q_logits).sum(-1, keepdims=True)))
  p = np.exp(p_logits - np.log(np.exp(p_logits).sum(-1, keepdims=True)))
  return (q * (np.log(q) - np.log(p))).sum(-1)


def _np_probs(logits):
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _np_tv(q, p):
  return 0.5 * np.abs(q - p).sum(-1)


def _np_js(q, p):
  m = (q + p) / 2
  return 0.5 * (q * np.log(q / m)).sum(-1) + 0.5 * (p * np.log(p / m)).sum(-1)


def _rand(key, shape):
  return jax.random.normal(jax.random.key(key), shape) * 2.0


def test_every_divergence_is_zero_when_student_equals_teacher():
  t = _rand(0, (2, 5, 11))
  for idx in (None, losses.top_n_indices(t, t, 4, 'teacher')[0]):
    for measure in losses.MEASURES:
      np.testing.assert_allclose(losses.distill_divergence(t, t, idx, measure=measure), 0.0, atol=1e-6)


def test_whole_vocabulary_kl_matches_numpy():
  t, s = _rand(1, (2, 3, 7)), _rand(2, (2, 3, 7))
  np.testing.assert_allclose(losses.distill_divergence(t, s), _np_kl(np.asarray(t), np.asarray(s)), rtol=1e-5)
  # Top-N with N = V, renormalised, is the whole-vocabulary KL.
  idx, _ = losses.top_n_indices(t, s, 7, 'teacher')
  np.testing.assert_allclose(losses.distill_divergence(t, s, idx), losses.distill_divergence(t, s), rtol=1e-5)


def test_top_n_renormalised_matches_hand_computation_and_n1_is_zero():
  t = jnp.array([[[3.0, 1.0, 2.0, -1.0]]])
  s = jnp.array([[[0.5, 2.0, 1.0, 0.0]]])
  idx, _ = losses.top_n_indices(t, s, 2, 'teacher')
  assert sorted(np.asarray(idx).ravel().tolist()) == [0, 2]
  # Renormalised over S = {0, 2}: teacher logits (3, 2), student (0.5, 1).
  expected = _np_kl(np.array([3.0, 2.0]), np.array([0.5, 1.0]))
  np.testing.assert_allclose(losses.distill_divergence(t, s, idx)[0, 0], expected, rtol=1e-5)
  idx1, _ = losses.top_n_indices(t, s, 1, 'teacher')
  assert float(losses.distill_divergence(t, s, idx1)[0, 0]) == 0.0


def test_partial_kl_uses_full_vocabulary_softmax():
  t = jnp.array([[[3.0, 1.0, 2.0, -1.0]]])
  s = jnp.array([[[0.5, 2.0, 1.0, 0.0]]])
  idx, _ = losses.top_n_indices(t, s, 2, 'teacher')
  lq, lp = jax.nn.log_softmax(t[0, 0]), jax.nn.log_softmax(s[0, 0])
  expected = sum(float(jnp.exp(lq[v]) * (lq[v] - lp[v])) for v in (0, 2))
  got = losses.distill_divergence(t, s, idx, renormalize=False)[0, 0]
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_forward_and_reverse_differ_on_an_asymmetric_case():
  t = jnp.log(jnp.array([[[0.9, 0.05, 0.05]]]))
  s = jnp.log(jnp.array([[[0.4, 0.3, 0.3]]]))
  fwd = float(losses.distill_divergence(t, s, measure='forward')[0, 0])
  rev = float(losses.distill_divergence(t, s, measure='reverse')[0, 0])
  np.testing.assert_allclose(fwd, 0.9 * np.log(0.9 / 0.4) + 2 * 0.05 * np.log(0.05 / 0.3), rtol=1e-5)
  np.testing.assert_allclose(rev, 0.4 * np.log(0.4 / 0.9) + 2 * 0.3 * np.log(0.3 / 0.05), rtol=1e-5)
  assert abs(fwd - rev) > 0.1


@pytest.mark.parametrize('measure, formula', [('tv', _np_tv), ('js', _np_js)])
def test_tv_and_js_match_numpy_and_are_symmetric(measure, formula):
  t, s = np.asarray(_rand(11, (2, 3, 7))), np.asarray(_rand(12, (2, 3, 7)))
  div = lambda a, b, *args, **kw: np.asarray(losses.distill_divergence(a, b, *args, measure=measure, **kw))
  whole = formula(_np_probs(t), _np_probs(s))
  np.testing.assert_allclose(div(t, s), whole, rtol=1e-5)
  np.testing.assert_allclose(div(s, t), whole, rtol=1e-5)  # symmetric
  assert np.all(whole > 0) and np.all(whole <= (1.0 if measure == 'tv' else np.log(2.0)))
  # Over a fixed index set S: renormalised, both distributions are softmaxes over S; not
  # renormalised, the whole-vocabulary probabilities' terms are summed over S.
  sel = np.array([0, 2, 5])
  idx = jnp.broadcast_to(jnp.asarray(sel), t.shape[:-1] + (3,))
  np.testing.assert_allclose(div(t, s, idx), formula(_np_probs(t[..., sel]), _np_probs(s[..., sel])), rtol=1e-5)
  np.testing.assert_allclose(div(s, t, idx), div(t, s, idx), rtol=1e-5)
  q, p = _np_probs(t)[..., sel], _np_probs(s)[..., sel]
  partial = 0.5 * np.abs(q - p).sum(-1) if measure == 'tv' else \
      0.5 * (q * np.log(2 * q / (q + p)) + p * np.log(2 * p / (q + p))).sum(-1)
  np.testing.assert_allclose(div(t, s, idx, renormalize=False), partial, rtol=1e-5)


def test_union_mode_index_set_is_teacher_and_student_top_n_without_duplicates():
  t = jnp.array([[[5.0, 4.0, 0.0, 0.0, 0.0, 0.0]]])
  s = jnp.array([[[4.0, 0.0, 0.0, 0.0, 0.0, 5.0]]])  # student top-2 = {5, 0}; 0 is shared
  idx, valid = losses.top_n_indices(t, s, 2, 'union')
  chosen = {int(i) for i, v in zip(np.asarray(idx).ravel(), np.asarray(valid).ravel()) if v}
  assert chosen == {0, 1, 5} and int(np.asarray(valid).sum()) == 3
  # The KL over the union equals a renormalised KL over exactly {0, 1, 5}.
  sel = np.array([0, 1, 5])
  expected = _np_kl(np.asarray(t)[0, 0, sel], np.asarray(s)[0, 0, sel])
  np.testing.assert_allclose(losses.distill_divergence(t, s, idx, valid)[0, 0], expected, rtol=1e-5)


def test_ensemble_teacher_is_the_mean_of_its_members():
  main, heads = _rand(3, (1, 6, 5)), _rand(4, (2, 1, 6, 5))
  got = jnp.exp(losses.ensemble_teacher(main, heads, 2))
  # Head 2 at position i: main at i+2 and head 1 at i+1 predict the same token.
  i = 1
  expected = (jax.nn.softmax(main[0, i + 2]) + jax.nn.softmax(heads[0, 0, i + 1])) / 2
  np.testing.assert_allclose(got[0, i], expected, rtol=1e-5)
  np.testing.assert_allclose(jnp.exp(losses.ensemble_teacher(main, heads, 1))[0, 0],
                             jax.nn.softmax(main[0, 1]), rtol=1e-5)


def test_target_mask_drops_the_last_k_positions_and_cross_document_targets():
  seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])          # inputs; 0 = padding
  tgt_seg = jnp.array([[1, 1, 2, 2, 2, 2, 0, 0]])      # targets = inputs shifted by one
  np.testing.assert_array_equal(losses.target_mask(seg, tgt_seg, 0)[0], [1, 1, 0, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(losses.target_mask(seg, tgt_seg, 1)[0], [1, 0, 0, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(losses.target_mask(seg, tgt_seg, 2)[0], [0, 0, 0, 1, 0, 0, 0, 0])


def _loss_inputs(k=2, b=2, t=8, v=9):
  logits = _rand(5, (b, t, v))
  mtp = _rand(6, (k, b, t, v))
  targets = jax.random.randint(jax.random.key(7), (b, t), 0, v)
  seg = jnp.ones((b, t), jnp.int32)
  return logits, mtp, targets, seg, seg


@pytest.mark.parametrize('divergence, selection', [('kl', 'top_k'), ('kl', 'threshold'), ('tv', 'threshold'),
                                                   ('js', 'threshold')])  # threshold: the hand-written gradients
def test_teacher_gradient_is_zero_with_detach_and_nonzero_without(divergence, selection):
  logits, mtp, targets, seg, tseg = _loss_inputs()

  def kl_only(main, detach):
    cfg = losses.LossConfig(beta=(1.0, 1.0), top_n=4, detach=detach, divergence=divergence, selection=selection)
    _, m = losses.mtp_d_loss(main, mtp, targets, seg, tseg, cfg)
    return m['distill/k1/kl'] + m['distill/k2/kl']
  assert float(jnp.abs(jax.grad(kl_only)(logits, True)).sum()) == 0.0
  assert float(jnp.abs(jax.grad(kl_only)(logits, False)).sum()) > 0.0


def test_mtp_d_loss_total_and_metrics_match_their_parts():
  logits, mtp, targets, seg, tseg = _loss_inputs()
  loss, m = losses.mtp_d_loss(logits, mtp, targets, seg, tseg,
                              losses.LossConfig(ce_weight=0.3, beta=(0.5, 0.25), top_n=4))
  expected = m['xent'] + 0.15 * (m['mtp/k1/xent'] + m['mtp/k2/xent']) + 0.5 * m['distill/k1/kl'] \
      + 0.25 * m['distill/k2/kl']
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  # Head 2's CE at position i is against targets[i+2] over positions 0..T-3.
  ce = losses.xent(mtp[1][:, :-2], targets[:, 2:]).mean()
  np.testing.assert_allclose(m['mtp/k2/xent'], ce, rtol=1e-5)
  # Head 2's KL at position i uses the main logits at i+2 as teacher.
  idx, _ = losses.top_n_indices(logits[:, 2:], None, 4, 'teacher')
  kl = losses.distill_divergence(logits[:, 2:], mtp[1][:, :-2], idx).mean()
  np.testing.assert_allclose(m['distill/k2/kl'], kl, rtol=1e-5)
  # Plain MTP: no KL terms at all.
  loss_ce, m_ce = losses.mtp_d_loss(logits, mtp, targets, seg, tseg, losses.LossConfig(beta=(0.5, 0.25), distill=False))
  assert 'distill/k1/kl' not in m_ce
  np.testing.assert_allclose(loss_ce, m['xent'] + 0.15 * (m['mtp/k1/xent'] + m['mtp/k2/xent']), rtol=1e-6)


def test_agreement_metric_counts_argmax_matches_with_the_main_head_at_i_plus_k():
  v = 4
  main_arg = jnp.array([[0, 1, 2, 3, 0, 1]])
  logits = jax.nn.one_hot(main_arg, v) * 5
  head_arg = jnp.array([[1, 2, 0, 1, 2, 3]])   # agrees with the main argmax at i+1 for i = 0, 1 only
  mtp = (jax.nn.one_hot(head_arg, v) * 5)[None]
  seg = jnp.ones((1, 6), jnp.int32)
  _, m = losses.mtp_d_loss(logits, mtp, main_arg, seg, seg, losses.LossConfig(beta=(1.0,), distill=False))
  np.testing.assert_allclose(m['mtp/k1/agree'], 2 / 5)   # positions 0..4 are valid for k = 1


def test_bad_arguments_raise():
  logits, mtp, targets, seg, tseg = _loss_inputs()
  with pytest.raises(ValueError, match='beta has 1 values'):
    losses.mtp_d_loss(logits, mtp, targets, seg, tseg, losses.LossConfig(beta=(1.0,)))
  with pytest.raises(ValueError, match="unknown kl 'sideways'"):
    losses.LossConfig(beta=(1.0, 1.0), kl='sideways')
  with pytest.raises(ValueError, match="unknown teacher 'student'"):
    losses.LossConfig(teacher='student')
  with pytest.raises(ValueError, match='top_n=0'):
    losses.LossConfig(top_n=0)
  with pytest.raises(ValueError, match="unknown divergence 'hellinger'"):
    losses.LossConfig(divergence='hellinger')
  with pytest.raises(ValueError, match="divergence='tv' is symmetric"):
    losses.LossConfig(divergence='tv', kl='reverse')


@pytest.mark.parametrize('kw', [
    dict(),
    dict(kl='reverse'),
    dict(renormalize=False),
    dict(renormalize=False, kl='reverse', tau=2.0),
    dict(top_n_mode='union'),
    dict(teacher='ensemble_mean'),
    dict(detach=False),
    dict(detach=False, kl='reverse', top_n_mode='union'),
    dict(divergence='tv'),
    dict(divergence='tv', renormalize=False, tau=2.0, top_n_mode='union'),
    dict(divergence='tv', teacher='ensemble_mean', detach=False),
    dict(divergence='js'),
    dict(divergence='js', renormalize=False, tau=0.7),
    dict(divergence='js', top_n_mode='union', teacher='ensemble_mean'),
    dict(divergence='js', detach=False, renormalize=False),
])
def test_threshold_loss_and_gradients_equal_top_k(kw):
  logits, mtp, targets, seg, tseg = loss_inputs()

  def loss(selection, main, heads):
    return losses.mtp_d_loss(main, heads, targets, seg, tseg,
                             losses.LossConfig(beta=(1.0, 0.5, 0.25), top_n=7, selection=selection, **kw))
  (want, m_want), g_want = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)('top_k', logits, mtp)
  (got, m_got), g_got = jax.jit(jax.value_and_grad(loss, argnums=(1, 2), has_aux=True),
                                static_argnums=0)('threshold', logits, mtp)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for key in m_want:
    np.testing.assert_allclose(m_got[key], m_want[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(g_got, g_want):  # f32 rounding, relative to the largest gradient entry
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))



def test_materialize_grad_is_the_identity_in_value_and_gradient():
  x = distinct_logits(30, (2, 3, 5))
  f = lambda x: jnp.sum(jnp.sin(losses.materialize_grad((x, 2 * x))[1]))
  np.testing.assert_allclose(jax.jit(jax.grad(f))(x), 2 * jnp.cos(2 * x), rtol=1e-6)



@pytest.mark.parametrize('mesh_shape, divergence', [((1, 1, 8), 'kl'), ((1, 2, 4), 'kl'), ((1, 2, 4), 'tv'),
                                                    ((1, 1, 8), 'js')])
def test_vocab_sharded_loss_equals_unsharded_and_never_gathers_the_vocabulary(mesh_shape, divergence):
  v = 96  # a size no other dimension has, to spot it in the HLO
  logits, mtp, targets, seg, tseg = loss_inputs(k=2, b=2, t=10, v=v)
  mesh = sharding.make_mesh(mesh_shape, ('data', 'fsdp', 'model'))

  def loss(main, heads):
    cfg = losses.LossConfig(beta=(1.0, 0.5), top_n=8, divergence=divergence)
    return losses.mtp_d_loss(main, heads, targets, seg, tseg, cfg)[0]
  grad_fn = jax.value_and_grad(loss, argnums=(0, 1))
  want, g_want = jax.jit(grad_fn)(logits, mtp)
  main_sh = NamedSharding(mesh, P(None, None, 'model'))
  heads_sh = NamedSharding(mesh, P(None, None, None, 'model'))
  jitted = jax.jit(grad_fn, in_shardings=(main_sh, heads_sh))
  args = jax.device_put(logits, main_sh), jax.device_put(mtp, heads_sh)
  got, g_got = jitted(*args)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  hlo = jitted.lower(*args).compile().as_text()
  assert 'all-reduce' in hlo  # the per-row reductions over V are combined across shards
  assert not [s for s in gathered_shapes(hlo) if v in s], 'a [.., V] operand is all-gathered'
