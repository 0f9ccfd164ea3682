"""The MTP-D loss from hidden states in row chunks: equal to the loss of the logits, its gradient flags, its refusals, vocab sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpd_jax import fused_loss, losses, sharding, train
from mtpd_jax.harness import recipe
from mtpd_jax.model import MTPTransformer
from conftest import gathered_shapes, loss_inputs, small_config


@pytest.mark.parametrize('kw', [
    dict(),                                          # 'teacher' mode: one shared teacher for all heads
    dict(tau=2.0),
    dict(renormalize=False, tau=0.7),
    dict(top_n=None),
    dict(kl='reverse', renormalize=False, tau=1.5),
    dict(top_n_mode='union', top_n=5),              # 'union' mode: head by head
    dict(distill=False),
    dict(divergence='tv'),                           # the symmetric divergences
    dict(divergence='tv', renormalize=False, top_n_mode='union', top_n=5),
    dict(divergence='js', tau=1.5),
    dict(divergence='js', renormalize=False, top_n=None),
    dict(far_heads=True),  # heads' selected logits > 40 nats below their maxima: the exact path
])
def test_fused_loss_from_hidden_states_equals_the_loss_of_the_logits(kw):
  k, b, t, d, v = 3, 2, 10, 6, 40
  hidden = jax.random.normal(jax.random.key(40), (k + 1, b, t, d))
  if kw.pop('far_heads', False):  # each head's logits: the main head's of its teacher row, times -30
    hidden = hidden.at[1:].set(jnp.stack([-30.0 * jnp.roll(hidden[0], -j, axis=1) for j in range(1, k + 1)]))
  w = jax.random.normal(jax.random.key(41), (d, v)) * 2.0
  _, _, targets, seg, tseg = loss_inputs(k=k, b=b, t=t, v=v)
  cfg = losses.LossConfig(**{'beta': (1.0, 0.5, 0.25), 'top_n': 7, **kw})

  def unfused(hidden, w):
    logits = jnp.einsum('kbtd,dv->kbtv', hidden, w)
    return losses.mtp_d_loss(logits[0], logits[1:], targets, seg, tseg, cfg, beta_scale=0.7)

  def fused(hidden, w):  # 3 chunks of 7 rows: the last one padded
    return fused_loss.mtp_d_loss_fused(hidden, w, targets, seg, tseg, cfg, beta_scale=0.7, chunk_rows=7)
  (want, m_want), g_want = jax.value_and_grad(unfused, argnums=(0, 1), has_aux=True)(hidden, w)
  (got, m_got), g_got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1), has_aux=True))(hidden, w)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert set(m_got) == set(m_want)
  for key in m_want:
    np.testing.assert_allclose(m_got[key], m_want[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def test_fused_loss_skips_only_the_gradients_a_frozen_trunk_and_unembedding_discard():
  k, b, t, d, v = 2, 2, 10, 6, 40
  hidden = jax.random.normal(jax.random.key(60), (k + 1, b, t, d))
  w = jax.random.normal(jax.random.key(61), (d, v)) * 2.0
  _, _, targets, seg, tseg = loss_inputs(k=k, b=b, t=t, v=v)

  def grads(**flags):
    cfg = losses.LossConfig(beta=(1.0, 0.5), top_n=7)
    fn = lambda h, w_: fused_loss.mtp_d_loss_fused(h, w_, targets, seg, tseg, cfg, chunk_rows=7, **flags)
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1), has_aux=True))(hidden, w)
  (loss, metrics), (g_h, g_w) = grads()
  (loss_f, metrics_f), (g_hf, g_wf) = grads(w_grad=False, main_grad=False)
  assert float(loss_f) == float(loss) and jax.tree.map(float, metrics_f) == jax.tree.map(float, metrics)
  np.testing.assert_allclose(g_hf[1:], g_h[1:], rtol=1e-5, atol=1e-7)  # the heads' rows: as before
  assert not np.any(g_hf[0]) and not np.any(g_wf) and np.any(g_h[0]) and np.any(g_w)


def test_train_steps_form_the_fused_gradients_their_labels_need():
  config = small_config()
  _, params = nnx.split(MTPTransformer(recipe.model_config(config), rngs=nnx.Rngs(0)), nnx.Param)
  flags = lambda trainable: train.fused_grad_flags(train.trainable_labels(params, trainable))
  assert flags('all') == dict(w_grad=True, main_grad=True)
  assert flags('mtp_heads') == dict(w_grad=False, main_grad=False)
  assert flags([2]) == dict(w_grad=False, main_grad=False)


def test_fused_loss_refuses_what_it_does_not_implement():
  hidden, w = jnp.zeros((2, 1, 4, 3)), jnp.zeros((3, 8))
  seg = jnp.ones((1, 4), jnp.int32)
  cfg = losses.LossConfig(top_n=2, detach=False)
  assert not fused_loss.supports(cfg) and fused_loss.supports(losses.LossConfig(top_n=2))
  assert fused_loss.supports(losses.LossConfig(distill=False, detach=False))  # no KL: nothing to detach
  with pytest.raises(ValueError, match='loss_chunk_rows=0'):
    fused_loss.mtp_d_loss_fused(hidden, w, seg, seg, seg, cfg)
  with pytest.raises(ValueError, match='loss_chunk_rows=0'):  # refused where the step is configured
    train.StepConfig(loss=cfg, loss_chunk_rows=256)
  assert train.StepConfig(loss=cfg).loss_chunk_rows == 0


@pytest.mark.parametrize('divergence', losses.DIVERGENCES)
def test_fused_loss_with_a_vocab_sharded_unembedding_equals_unsharded(divergence):
  k, b, t, d, v = 2, 2, 8, 6, 96
  hidden = jax.random.normal(jax.random.key(50), (k + 1, b, t, d))
  w = jax.random.normal(jax.random.key(51), (d, v)) * 2.0
  _, _, targets, seg, tseg = loss_inputs(k=k, b=b, t=t, v=v)
  mesh = sharding.make_mesh((2, 1, 4), ('data', 'fsdp', 'model'))

  def loss(hidden, w):
    cfg = losses.LossConfig(beta=(1.0, 0.5), top_n=8, divergence=divergence)
    return fused_loss.mtp_d_loss_fused(hidden, w, targets, seg, tseg, cfg, chunk_rows=8)[0]
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
  assert not [s for s in gathered_shapes(hlo) if v in s], 'a [.., V] operand is all-gathered'
