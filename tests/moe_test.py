"""Mixture of Experts: top-k routing, dispatch = a dense reference, balancing, sharding, training, decoding."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import small_config
from configs import model as model_presets
from mtpd_jax import decode, moe, sharding, train
from mtpd_jax.harness import recipe, training, validation
from mtpd_jax import model as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE_CFG = moe.MoEConfig(num_experts=4, top_k=2, expert_dim=16, num_shared_experts=1)
CFG = M.ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
                    num_mtp_heads=2, moe=MOE_CFG)


def _moe_config(num_mtp_heads=2, **moe_fields):
  c = small_config(num_mtp_heads)
  c.model.moe.update(dict(num_experts=4, top_k=2, expert_dim=16, num_shared_experts=1, **moe_fields))
  return c


def test_routing_sends_each_token_to_exactly_top_k_distinct_experts():
  logits = jax.random.normal(jax.random.key(0), (40, 6))
  idx, gates, probs = moe.route(logits, jnp.zeros(6), top_k=3, renormalize=True)
  want = np.argsort(-np.asarray(probs), axis=-1)[:, :3]
  np.testing.assert_array_equal(np.sort(idx, -1), np.sort(want, -1))
  np.testing.assert_allclose(gates.sum(-1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(gates, np.take_along_axis(np.asarray(probs), np.asarray(idx), -1)
                             / np.take_along_axis(np.asarray(probs), np.asarray(idx), -1).sum(-1, keepdims=True),
                             rtol=1e-6)
  # With room for every choice, each token is dispatched to exactly 3 slots of 3 distinct experts.
  dispatch, combine, keep = moe.dispatch_masks(idx.reshape(4, 10, 3), gates.reshape(4, 10, 3),
                                               jnp.ones((4, 10), bool), 6, capacity=10)
  assert bool(keep.all())
  np.testing.assert_array_equal(dispatch.sum((-1, -2)), 3)
  np.testing.assert_array_equal(dispatch.sum(-1).max(), 1)
  np.testing.assert_allclose(combine.sum((-1, -2)), 1.0, rtol=1e-6)
  # A bias moves the choice but not the gate values: the gates still come from the softmax.
  bias = jnp.zeros(6).at[5].set(10.0)
  idx_b, gates_b, _ = moe.route(logits, bias, top_k=1, renormalize=False)
  assert bool((idx_b[:, 0] == 5).all())
  np.testing.assert_allclose(gates_b[:, 0], probs[:, 5], rtol=1e-6)


def _reference(layer: moe.MoE, x_BxTxD, capacity: int | None, group: int):
  """Token by token, choice by choice: each expert takes choices until its `capacity` per group is full."""
  cfg = layer.cfg
  wr, wg, wu, wd = (np.asarray(w[...], np.float64) for w in (layer.w_router, layer.w_gate, layer.w_up, layer.w_down))
  x = np.asarray(x_BxTxD, np.float64)
  logits = x @ wr
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out, dropped = np.zeros_like(x), 0
  for b in range(x.shape[0]):
    for start in range(0, x.shape[1], group):
      used = np.zeros(cfg.num_experts, int)
      for t in range(start, min(start + group, x.shape[1])):
        chosen = np.argsort(-probs[b, t])[:cfg.top_k]
        gates = probs[b, t, chosen] / probs[b, t, chosen].sum()
        for e, gate in zip(chosen, gates):
          if capacity is not None and used[e] >= capacity:
            dropped += 1
            continue
          used[e] += 1
          h = x[b, t] @ wg[e]
          out[b, t] += gate * ((h / (1 + np.exp(-h))) * (x[b, t] @ wu[e])) @ wd[e]
  return out, dropped / (x.shape[0] * x.shape[1] * cfg.top_k)


@pytest.mark.parametrize('t,group_size,factor,dropless', [
    (6, 3, 0.5, False),   # one slot per expert per group of 3: choices are dropped
    (7, 3, 0.5, False),   # a ragged last group (padded; the padding takes no slot)
    (8, 0, 1.0, False),   # the whole sequence is one group
    (8, 4, 0.5, True),    # dropless: every choice counts, whatever the capacity
])
def test_dispatch_equals_a_dense_reference(t, group_size, factor, dropless):
  cfg = moe.MoEConfig(num_experts=4, top_k=2, expert_dim=8, capacity_factor=factor, group_size=group_size)
  layer = moe.MoE(12, cfg, nnx.Rngs(0))
  layer.w_router[...] = jax.random.normal(jax.random.key(1), (12, 4))  # decisive routing
  x = jax.random.normal(jax.random.key(2), (3, t, 12))
  out, stats = layer(x, dropless=dropless)
  group = group_size or t
  want, dropped = _reference(layer, x, None if dropless else cfg.capacity(group), group)
  np.testing.assert_allclose(out, want, atol=2e-5)
  np.testing.assert_allclose(stats['dropped_frac'], dropped, atol=1e-6)
  if dropless:
    assert dropped == 0
  elif factor < 1:
    assert dropped > 0


def test_capacity_dropping_keeps_every_head_causal():
  cfg = M.ModelConfig(**{**CFG.__dict__, 'moe': moe.MoEConfig(num_experts=4, top_k=2, expert_dim=16,
                                                                 capacity_factor=0.5)})
  model = M.MTPTransformer(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (1, 12), 0, 64)
  base = model(tokens)
  assert float(base.aux['metrics']['moe/dropped_frac']) > 0.2
  for j in (3, 8):
    out = model(tokens.at[0, j].set((tokens[0, j] + 1) % 64))
    assert np.abs(np.asarray(out.logits_BxTxV - base.logits_BxTxV))[0, :j].max() == 0
    for k in (1, 2):  # head k at position i reads token i+k
      diff = np.abs(np.asarray(out.mtp_logits_KxBxTxV[k - 1] - base.mtp_logits_KxBxTxV[k - 1]))[0]
      assert diff[:j - k].max() == 0, (j, k)


@pytest.mark.parametrize('k', [0, 2])
def test_param_count_total_and_active(k):
  cfg = M.ModelConfig(**{**CFG.__dict__, 'num_mtp_heads': k})
  _, params = nnx.split(M.MTPTransformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  total = sum(x.size for x in jax.tree.leaves(params))
  assert total == M.param_count(cfg)
  expert_weights = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(params)
                       if re.search(r"\['moe'\]\['w_(gate|up|down)'\]", jax.tree_util.keystr(p)))
  assert M.param_count(cfg, active=True) == total - expert_weights * (4 - 2) // 4
  dense = M.ModelConfig(**{**cfg.__dict__, 'moe': moe.MoEConfig()})
  assert M.param_count(dense, active=True) == M.param_count(dense)


@pytest.mark.parametrize('mechanism', ['aux_loss', 'bias'])
def test_balancing_evens_out_the_load_of_a_skewed_router(mechanism):
  """Tokens that share a direction the router favours first go to the same two experts; balancing
  spreads them (the bias needs tokens that differ: it can only shift which ones tip over)."""
  cfg = moe.MoEConfig(num_experts=4, top_k=2, expert_dim=8, bias_update_rate=0.01)
  layer = moe.MoE(16, cfg, nnx.Rngs(0))
  u = jax.random.normal(jax.random.key(1), (16,))
  x = u + 2.0 * jax.random.normal(jax.random.key(2), (4, 64, 16))
  layer.w_router[...] = jnp.outer(u, jnp.array([1.0, 0.6, -0.5, -1.0])) / 4 + 0.02 * jax.random.normal(
      jax.random.key(3), (16, 4))
  graphdef, params = nnx.split(layer, nnx.Param)

  def stats(params):
    return nnx.merge(graphdef, params)(x, dropless=True)[1]
  before = float(stats(params)['max_load'])
  assert before > 1.8  # 2 = every token picks the same two of the four experts

  if mechanism == 'aux_loss':  # the router trained on the balancing loss alone
    tx = optax.adam(0.02)
    opt_state = tx.init(params['w_router'])

    @jax.jit
    def step(params, opt_state):
      g = jax.grad(lambda w: stats({**params, 'w_router': w})['aux_loss'])(params['w_router'])
      updates, opt_state = tx.update(g, opt_state)
      return {**params, 'w_router': optax.apply_updates(params['w_router'], updates)}, opt_state
    for _ in range(150):
      params, opt_state = step(params, opt_state)
  else:  # no gradient at all: only the bias moves, by the forward itself
    @jax.jit
    def step(params):
      layer = nnx.merge(graphdef, params)
      layer(x, dropless=True, move_bias=True)
      return nnx.state(layer, nnx.Param)
    for _ in range(150):
      params = step(params)
    assert float(jnp.abs(params['router_bias'][...]).max()) > 0.05
  after = float(stats(params)['max_load'])
  assert after < 1.25, (before, after)


def test_router_biases_are_found_by_type_and_moved_only_where_they_train():
  """Every router bias (trunk and heads, with or without remat) is a moe.RouterBias; the train step's
  forward moves each by ±rate, and train_step keeps that step only for trainable biases."""
  rate = 0.01
  cfg = M.ModelConfig(**{**CFG.__dict__, 'moe': moe.MoEConfig(num_experts=4, top_k=2, expert_dim=16,
                                                                 bias_update_rate=rate)})
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 64)
  moved = []
  for remat in (False, True):
    graphdef, params = nnx.split(M.MTPTransformer(dataclasses.replace(cfg, remat=remat), rngs=nnx.Rngs(0)),
                                 nnx.Param)
    biases = nnx.filter_state(params, moe.RouterBias)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(biases)]
    assert len(paths) == cfg.num_layers + cfg.num_mtp_heads and all('router_bias' in p for p in paths)

    @jax.jit
    def forward(params):
      model = nnx.merge(graphdef, params)
      model(tokens, move_router_biases=True)
      return nnx.state(model, moe.RouterBias)
    after = forward(params)
    assert all(np.allclose(np.abs(b), rate) for b in jax.tree.leaves(after))
    moved.append(after)
  jax.tree.map(np.testing.assert_array_equal, *moved)  # remat changes nothing
  labels = train.trainable_labels(params, 'mtp_heads')
  updated = jax.tree.map(lambda p: p + 1.0, params)  # stands for the optimizer's result
  kept = moe.keep_moved_biases(updated, params, moved[0], labels)
  for path, value in jax.tree_util.tree_leaves_with_path(nnx.filter_state(kept, moe.RouterBias)):
    step = np.abs(np.asarray(value) - 1.0)
    expect = rate if 'mtp_heads' in jax.tree_util.keystr(path) else 0.0  # the frozen trunk's stay put
    np.testing.assert_allclose(step, expect, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  others = lambda state: nnx.filter_state(state, nnx.Not(moe.RouterBias))
  jax.tree.map(np.testing.assert_array_equal, others(kept), others(updated))  # the rest as the optimizer left it

def _setup(config, mesh):
  abstract, shardings = training.abstract_state(config, mesh)
  state = training.init_state(config, abstract, shardings)
  step_fn, _ = training.make_steps(config, mesh, shardings)
  return state, step_fn


@pytest.mark.slow
def test_expert_sharded_step_equals_the_single_device_step():
  config = _moe_config(num_mtp_heads=1, bias_update_rate=0.01)
  config.train.eps = 1e-3  # as train_test: Adam's first steps amplify reduction-order noise otherwise
  batch = next(recipe.make_data_iterator(config, 'train'))
  results = []
  for mesh in (sharding.make_mesh((2, 4), ('fsdp', 'expert')),
               sharding.make_mesh((1, 1), ('fsdp', 'expert'), devices=jax.devices()[:1])):
    with jax.set_mesh(mesh):
      state, step_fn = _setup(config, mesh)
      if mesh.size == 8:  # experts really are split over the expert axis, the batch over both
        w = state.params['blocks'][0]['moe']['w_gate'][...]
        assert w.sharding.spec == jax.sharding.PartitionSpec('expert', 'fsdp', None)
        assert sharding.batch_spec(mesh) == jax.sharding.PartitionSpec(('fsdp', 'expert'))
      history = []
      for _ in range(3):
        state, metrics = step_fn(state, sharding.put_batch(batch, mesh))
        history.append([float(metrics[k]) for k in ('loss', 'grad_norm', 'moe/aux_loss', 'moe/max_load',
                                                    'moe/dropped_frac')])
      params = {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state.params)}
      results.append((history, params))
  (hist_a, params_a), (hist_b, params_b) = results
  np.testing.assert_allclose(hist_a, hist_b, atol=1e-5)
  for name in params_a:
    np.testing.assert_allclose(params_a[name], params_b[name], atol=1e-5, err_msg=name)
  # The bias step moved every router bias (they get no gradient, so only train_step moves them).
  bias = params_a["['blocks'][0]['moe']['router_bias'].value"]
  assert np.all(np.isclose(np.abs(bias), 0.01) | np.isclose(np.abs(bias), 0.03)), bias


@pytest.mark.slow
def test_moe_tiny_trunk_trains_with_mtpd_heads(tmp_path):
  config = small_config(num_mtp_heads=2, steps=40)
  model_presets.apply(config, 'moe_tiny')
  config.train.log_every = 10
  assert recipe.model_config(config).moe.num_experts == 4
  training.train_and_evaluate(config, str(tmp_path), progress=False)
  with open(tmp_path / 'metrics.jsonl') as f:
    rows = [r for r in map(json.loads, f) if 'train/loss' in r]
  assert rows[-1]['train/loss'] < 0.85 * rows[0]['train/loss']
  assert rows[-1]['train/distill/k1/kl'] >= 0 and rows[-1]['train/mtp/k2/xent'] < rows[0]['train/mtp/k2/xent']
  for row in rows:
    assert 0.9 < row['train/moe/aux_loss'] < 2.0
    assert 1.0 <= row['train/moe/max_load'] <= 2.0  # 4 experts, top-2: at most 2x an even share
    assert 0.0 <= row['train/moe/dropped_frac'] < 0.5


@pytest.fixture(scope='module')
def trained_moe():
  from benchmarks import tiny_heads
  cfg = M.ModelConfig(vocab_size=32, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                      num_mtp_heads=2, max_seq_len=128, moe=moe.MoEConfig(num_experts=4, top_k=2, expert_dim=32))
  return tiny_heads.train_tiny(cfg, steps=150, batch_size=8, seq_len=32, lr=3e-3)


@pytest.mark.parametrize('depth', [1, 3])
def test_speculative_greedy_with_a_moe_model_equals_plain_greedy(trained_moe, depth):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 32, n) for n in (3, 9, 6)]
  plain = decode.generate(trained_moe, prompts, max_new_tokens=20)
  spec = decode.generate(trained_moe, prompts, max_new_tokens=20, draft_depth=depth)
  for want, got in zip(plain.tokens, spec.tokens):
    np.testing.assert_array_equal(got, want)
  assert np.mean(np.concatenate(spec.accept_lengths)) > 0.2  # drafts are accepted, so verify really ran


def test_bad_moe_values_are_refused():
  with pytest.raises(ValueError, match=r'model\.moe\.top_k=5 must lie in 1\.\.model\.moe\.num_experts=4'):
    validation.validate_config(_bad(top_k=5))
  with pytest.raises(ValueError, match='group_size=5 does not divide data.seq_len=16'):
    validation.validate_config(_bad(group_size=5))
  with pytest.raises(ValueError, match='unknown model preset'):
    model_presets.apply(small_config(), 'moe_huge')


def _bad(**fields):
  c = _moe_config()
  c.model.moe.update(fields)
  return c


def test_model_preset_switch_keeps_command_line_model_overrides():
  from experiments import run
  config = small_config()
  config.model.moe.num_experts = 8
  run.with_model_preset(config, 'dense_tiny', {'model.num_layers': 3, 'train.steps': 99})
  assert (config.model.dim, config.model.num_layers, config.model.moe.num_experts) == (64, 3, 0)
  assert config.model.vocab_size == 64 and config.train.steps == 8  # the experiment's, untouched
  assert set(model_presets.names()) >= {'dense_2b', 'moe_10b_a1b', 'moe_tiny', 'dense_tiny'}


def test_bad_model_preset_is_one_line_exit_2(tmp_path):
  proc = subprocess.run([sys.executable, '-m', 'experiments.run', '--config=tiny', '--config.model=moe_huge',
                         f'--workdir={tmp_path}'], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.count('\n') == 1 and "error: unknown model preset 'moe_huge'" in proc.stderr, proc.stderr
  assert not os.listdir(tmp_path)
