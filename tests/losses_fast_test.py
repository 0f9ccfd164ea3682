"""The threshold Top-N selection and its masked KL: same values and gradients as top_k, and sharded over V."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpd_jax import losses, sharding


def _distinct(key, shape, scale=3.0):
  """Logits with distinct values in every row (a random permutation of a grid, plus noise)."""
  v = shape[-1]
  perm = jax.random.permutation(jax.random.key(key), v * 8)[:v].astype(jnp.float32)
  noise = jax.random.uniform(jax.random.key(key + 1), shape, minval=0.0, maxval=0.5)
  shuffle = jax.vmap(lambda k: jax.random.permutation(k, perm))(
      jax.random.split(jax.random.key(key + 2), int(np.prod(shape[:-1]))))
  return (shuffle.reshape(shape) + noise) * scale / v


def _top_k_mask(logits, n):
  idx = jax.lax.top_k(logits, n)[1]
  return jnp.any(jax.nn.one_hot(idx, logits.shape[-1], dtype=bool), axis=-2)


@pytest.mark.parametrize('n', [1, 2, 17, 50, 99, 100])
def test_threshold_selects_exactly_the_top_k_set_of_distinct_logits(n):
  logits = _distinct(0, (3, 5, 100))
  thr, steps = losses.top_n_threshold(logits, n, return_steps=True)
  np.testing.assert_array_equal(logits > thr[..., None], _top_k_mask(logits, n))
  assert int(steps) <= 64


def test_threshold_on_a_wide_skewed_vocabulary_matches_top_k():
  # LM-like rows: a few large logits over a long tail; N is the paper's 8.1% of V.
  logits = jnp.log(jax.random.dirichlet(jax.random.key(3), jnp.full((4000,), 0.05), (16,)) + 1e-30)
  logits = jnp.maximum(logits, -60.0) + _distinct(4, (16, 4000), scale=1e-3)
  n = round(0.081 * 4000)
  thr = losses.top_n_threshold(logits, n)
  np.testing.assert_array_equal(logits > thr[:, None], _top_k_mask(logits, n))


def test_ties_at_the_nth_value_are_all_selected():
  logits = jnp.array([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0],
                      [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
  sel = logits > losses.top_n_threshold(logits, 2)[:, None]
  # Row 0: the 2nd largest value (3.0) is tied three ways: all three are kept.
  np.testing.assert_array_equal(sel, [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize('direction', ['forward', 'reverse'])
@pytest.mark.parametrize('renormalize', [True, False])
def test_threshold_kl_equals_gathered_top_k_kl(direction, renormalize):
  t, s = _distinct(5, (2, 4, 64)), _distinct(6, (2, 4, 64), scale=5.0)
  idx, valid = losses.top_n_indices(t, s, 9, 'teacher')
  want = losses.kl_divergence(t, s, idx, valid, direction=direction, renormalize=renormalize, tau=0.7)
  got = losses.kl_divergence(t, s, direction=direction, renormalize=renormalize, tau=0.7,
                             threshold_BxT=losses.top_n_threshold(t, 9))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_threshold_union_counts_shared_indices_once():
  t = jnp.array([[[5.0, 4.0, 0.0, 0.1, 0.2, 0.3]]])
  s = jnp.array([[[4.0, 0.0, 0.1, 0.2, 0.3, 5.0]]])  # student top-2 = {5, 0}; 0 is shared
  got = losses.kl_divergence(t, s, threshold_BxT=losses.top_n_threshold(t, 2),
                             student_threshold_BxT=losses.top_n_threshold(s, 2))
  sel = np.array([0, 1, 5])
  q = jax.nn.log_softmax(t[0, 0, sel])
  p = jax.nn.log_softmax(s[0, 0, sel])
  np.testing.assert_allclose(got[0, 0], jnp.sum(jnp.exp(q) * (q - p)), rtol=1e-5)


def test_threshold_n1_is_zero_and_n_equals_v_is_the_whole_vocabulary_kl():
  t, s = _distinct(7, (2, 3, 11)), _distinct(8, (2, 3, 11))
  kl1 = losses.kl_divergence(t, s, threshold_BxT=losses.top_n_threshold(t, 1))
  np.testing.assert_array_equal(kl1, 0.0)
  klv = losses.kl_divergence(t, s, threshold_BxT=losses.top_n_threshold(t, 11))
  np.testing.assert_allclose(klv, losses.kl_divergence(t, s), rtol=1e-5)


def _loss_inputs(k=3, b=2, t=10, v=40):
  logits = _distinct(9, (b, t, v), scale=6.0)
  mtp = jnp.stack([_distinct(10 + j, (b, t, v), scale=6.0) for j in range(k)])
  targets = jax.random.randint(jax.random.key(20), (b, t), 0, v)
  seg = jnp.ones((b, t), jnp.int32).at[1, 6:].set(2)  # two documents in row 1
  tseg = jnp.ones((b, t), jnp.int32).at[1, 5:].set(2)
  return logits, mtp, targets, seg, tseg


@pytest.mark.parametrize('kw', [
    dict(),
    dict(kl='reverse'),
    dict(renormalize=False),
    dict(renormalize=False, kl='reverse', tau=2.0),
    dict(top_n_mode='union'),
    dict(teacher='ensemble_mean'),
    dict(detach=False),
    dict(detach=False, kl='reverse', top_n_mode='union'),
])
def test_threshold_loss_and_gradients_equal_top_k(kw):
  logits, mtp, targets, seg, tseg = _loss_inputs()

  def loss(selection, main, heads):
    return losses.mtp_d_loss(main, heads, targets, seg, tseg, beta=(1.0, 0.5, 0.25), top_n=7,
                             selection=selection, **kw)
  (want, m_want), g_want = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)('top_k', logits, mtp)
  (got, m_got), g_got = jax.jit(jax.value_and_grad(loss, argnums=(1, 2), has_aux=True),
                                static_argnums=0)('threshold', logits, mtp)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for key in m_want:
    np.testing.assert_allclose(m_got[key], m_want[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(g_got, g_want):  # f32 rounding, relative to the largest gradient entry
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def test_materialize_grad_is_the_identity_in_value_and_gradient():
  x = _distinct(30, (2, 3, 5))
  f = lambda x: jnp.sum(jnp.sin(losses.materialize_grad((x, 2 * x))[1]))
  np.testing.assert_allclose(jax.jit(jax.grad(f))(x), 2 * jnp.cos(2 * x), rtol=1e-6)


def _gathered_shapes(hlo: str) -> list[list[int]]:
  shapes = []
  for line in hlo.splitlines():
    if re.search(r'\ball-gather(-start)?\(', line):
      lhs = line.split('all-gather')[0]
      shapes += [[int(d) for d in dims.split(',') if d] for dims in re.findall(r'\w+\[([\d,]*)\]', lhs)]
  return shapes


@pytest.mark.parametrize('mesh_shape', [(1, 1, 8), (1, 2, 4)])
def test_vocab_sharded_loss_equals_unsharded_and_never_gathers_the_vocabulary(mesh_shape):
  v = 96  # a size no other dimension has, to spot it in the HLO
  logits, mtp, targets, seg, tseg = _loss_inputs(k=2, b=2, t=10, v=v)
  mesh = sharding.make_mesh(mesh_shape, ('data', 'fsdp', 'model'))

  def loss(main, heads):
    return losses.mtp_d_loss(main, heads, targets, seg, tseg, beta=(1.0, 0.5), top_n=8)[0]
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
  assert not [s for s in _gathered_shapes(hlo) if v in s], 'a [.., V] operand is all-gathered'


@pytest.mark.parametrize('kw', [
    dict(),
    dict(kl='reverse', renormalize=False, tau=1.5),
    dict(top_n_mode='union', top_n=5),
    dict(top_n=None),
    dict(distill=False),
])
def test_fused_loss_from_hidden_states_equals_the_loss_of_the_logits(kw):
  from mtpd_jax import fused_loss
  k, b, t, d, v = 3, 2, 10, 6, 40
  hidden = jax.random.normal(jax.random.key(40), (k + 1, b, t, d))
  w = jax.random.normal(jax.random.key(41), (d, v)) * 2.0
  _, _, targets, seg, tseg = _loss_inputs(k=k, b=b, t=t, v=v)
  kw = {'beta': (1.0, 0.5, 0.25), 'top_n': 7, 'beta_scale': 0.7, **kw}

  def unfused(hidden, w):
    logits = jnp.einsum('kbtd,dv->kbtv', hidden, w)
    return losses.mtp_d_loss(logits[0], logits[1:], targets, seg, tseg, **kw)

  def fused(hidden, w):  # 3 chunks of 7 rows: the last one padded
    return fused_loss.mtp_d_loss_fused(hidden, w, targets, seg, tseg, chunk_rows=7, **kw)
  (want, m_want), g_want = jax.value_and_grad(unfused, argnums=(0, 1), has_aux=True)(hidden, w)
  (got, m_got), g_got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1), has_aux=True))(hidden, w)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert set(m_got) == set(m_want)
  for key in m_want:
    np.testing.assert_allclose(m_got[key], m_want[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def test_fused_loss_skips_only_the_gradients_a_frozen_trunk_and_unembedding_discard():
  from mtpd_jax import fused_loss
  k, b, t, d, v = 2, 2, 10, 6, 40
  hidden = jax.random.normal(jax.random.key(60), (k + 1, b, t, d))
  w = jax.random.normal(jax.random.key(61), (d, v)) * 2.0
  _, _, targets, seg, tseg = _loss_inputs(k=k, b=b, t=t, v=v)

  def grads(**flags):
    fn = lambda h, w_: fused_loss.mtp_d_loss_fused(h, w_, targets, seg, tseg, beta=(1.0, 0.5), top_n=7,
                                                   chunk_rows=7, **flags)
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(hidden, w)
  (loss, metrics), (g_h, g_w) = grads()
  (loss_f, metrics_f), (g_hf, g_wf) = grads(w_grad=False, main_grad=False)
  assert float(loss_f) == float(loss) and jax.tree.map(float, metrics_f) == jax.tree.map(float, metrics)
  np.testing.assert_allclose(g_hf[1:], g_h[1:], rtol=1e-5, atol=1e-7)  # the heads' rows: as before
  assert not np.any(g_hf[0]) and not np.any(g_wf) and np.any(g_h[0]) and np.any(g_w)


def test_train_steps_form_the_fused_gradients_their_labels_need():
  from mtpd_jax import recipe, train
  from mtpd_jax.model import MTPTransformer
  from conftest import small_config
  config = small_config()
  _, params = nnx.split(MTPTransformer(recipe.model_config(config), rngs=nnx.Rngs(0)), nnx.Param)
  flags = lambda trainable: train.fused_grad_flags(recipe.trainable_labels(params, trainable))
  assert flags('all') == dict(w_grad=True, main_grad=True)
  assert flags('mtp_heads') == dict(w_grad=False, main_grad=False)
  assert flags([2]) == dict(w_grad=False, main_grad=False)


def test_fused_loss_refuses_what_it_does_not_implement():
  from mtpd_jax import fused_loss
  hidden, w = jnp.zeros((2, 1, 4, 3)), jnp.zeros((3, 8))
  seg = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match='use losses.mtp_d_loss'):
    fused_loss.mtp_d_loss_fused(hidden, w, seg, seg, seg, top_n=2, detach=False)


def test_fused_loss_with_a_vocab_sharded_unembedding_equals_unsharded():
  from mtpd_jax import fused_loss
  k, b, t, d, v = 2, 2, 8, 6, 96
  hidden = jax.random.normal(jax.random.key(50), (k + 1, b, t, d))
  w = jax.random.normal(jax.random.key(51), (d, v)) * 2.0
  _, _, targets, seg, tseg = _loss_inputs(k=k, b=b, t=t, v=v)
  mesh = sharding.make_mesh((2, 1, 4), ('data', 'fsdp', 'model'))

  def loss(hidden, w):
    return fused_loss.mtp_d_loss_fused(hidden, w, targets, seg, tseg, beta=(1.0, 0.5), top_n=8, chunk_rows=8)[0]
  grad_fn = jax.value_and_grad(loss, argnums=(0, 1))
  want, g_want = jax.jit(grad_fn)(hidden, w)
  shardings = (NamedSharding(mesh, P(None, 'data')), NamedSharding(mesh, P(None, 'model')))
  jitted = jax.jit(grad_fn, in_shardings=shardings)
  args = [jax.device_put(x, s) for x, s in zip((hidden, w), shardings)]
  got, g_got = jitted(*args)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b_ in zip(g_got, g_want):
    np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-5 * float(jnp.abs(b_).max()))
  hlo = jitted.lower(*args).compile().as_text()
  assert not [s for s in _gathered_shapes(hlo) if v in s], 'a [.., V] operand is all-gathered'
