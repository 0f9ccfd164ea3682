"""Training: sharded step equivalence, learning, freezing, checkpoint round trips and exact resume."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import small_config
from mtpd_jax import checkpoint, sharding
from mtpd_jax.harness import recipe, training


def _setup(config, mesh):
  abstract, shardings = training.abstract_state(config, mesh)
  state = training.init_state(config, abstract, shardings)
  step_fn, eval_fn = training.make_steps(config, mesh, shardings)
  return abstract, state, step_fn, eval_fn


def _params(state):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state.params)}


@pytest.mark.slow
def test_step_on_a_4x2_mesh_equals_the_single_device_step():
  config = small_config()
  # Adam's first steps are ±lr for any |g| >> eps, which turns 1e-9 reduction-order noise in
  # near-zero gradients into lr-sized jumps; a larger eps keeps the update a smooth function of g.
  config.train.eps = 1e-3
  batch = next(recipe.make_data_iterator(config, 'train'))
  results = []
  for mesh in (sharding.make_mesh((4, 2), ('fsdp', 'model')),
               sharding.make_mesh((1, 1), ('fsdp', 'model'), devices=jax.devices()[:1])):
    with jax.set_mesh(mesh):
      _, state, step_fn, _ = _setup(config, mesh)
      if mesh.size == 8:  # the parameters really are split over the mesh
        w = state.params['blocks'][0]['mlp']['w_gate'][...]
        assert w.sharding.spec == jax.sharding.PartitionSpec('fsdp', 'model')
      losses = []
      for _ in range(3):
        state, metrics = step_fn(state, sharding.put_batch(batch, mesh))
        losses.append((float(metrics['loss']), float(metrics['grad_norm'])))
      results.append((losses, _params(state)))
  (loss_a, params_a), (loss_b, params_b) = results
  np.testing.assert_allclose(loss_a, loss_b, atol=1e-5)
  for name in params_a:
    np.testing.assert_allclose(params_a[name], params_b[name], atol=1e-5, err_msg=name)


def _read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_loss_falls_and_metrics_jsonl_has_every_key(tmp_path):
  config = small_config(num_mtp_heads=2, steps=40)
  config.train.log_every = 10
  training.train_and_evaluate(config, str(tmp_path), progress=False)
  rows = [r for r in _read_metrics(str(tmp_path)) if 'train/loss' in r]
  assert [r['step'] for r in rows] == [10, 20, 30, 40]
  keys = {'step', 'train/loss', 'train/xent', 'train/grad_norm', 'train/lr', 'train/tokens_per_s'}
  for k in (1, 2):
    keys |= {f'train/mtp/k{k}/xent', f'train/distill/k{k}/kl', f'train/mtp/k{k}/agree'}
  assert keys <= set(rows[0])
  assert rows[-1]['train/loss'] < 0.85 * rows[0]['train/loss']
  assert rows[-1]['train/mtp/k1/xent'] < rows[0]['train/mtp/k1/xent']
  assert json.load(open(tmp_path / 'config.json'))['model']['num_mtp_heads'] == 2


@pytest.mark.slow
def test_save_restore_gives_identical_state_and_next_batch(tmp_path):
  config = small_config()
  mesh = sharding.make_mesh((4, 2), ('fsdp', 'model'))
  with jax.set_mesh(mesh):
    abstract, state, step_fn, _ = _setup(config, mesh)
    it = recipe.make_data_iterator(config, 'train')
    for _ in range(3):
      state, _ = step_fn(state, sharding.put_batch(next(it), mesh))
    ckpt = checkpoint.Checkpointer(str(tmp_path), every_steps=1, max_to_keep=2)
    ckpt.save(3, state, it)
    expected_batch = next(it)
    fresh_it = recipe.make_data_iterator(config, 'train')
    restored = ckpt.restore(ckpt.latest_step(), abstract, fresh_it)
    ckpt.close()
  assert int(restored.step) == 3
  for (name, a), b in zip(_params(state).items(), _params(restored).values()):
    np.testing.assert_array_equal(a, b, err_msg=name)
  for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(restored.opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert restored.params['embed'][...].sharding == state.params['embed'][...].sharding
  np.testing.assert_array_equal(next(fresh_it)['inputs'], expected_batch['inputs'])


@pytest.mark.slow
def test_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
  config = small_config(steps=8)   # checkpoints at 4 and 8
  full, resumed = str(tmp_path / 'full'), str(tmp_path / 'resumed')
  training.train_and_evaluate(config, full, progress=False)
  # A run killed after its step-4 checkpoint: the same workdir without the later checkpoint.
  shutil.copytree(full, resumed)
  shutil.rmtree(os.path.join(resumed, 'checkpoints', '8'))
  training.train_and_evaluate(config, resumed, progress=False)
  model_full, _ = training.restore_model(full)
  model_resumed, _ = training.restore_model(resumed)
  for a, b in zip(jax.tree.leaves(nnx.state(model_full, nnx.Param)),
                  jax.tree.leaves(nnx.state(model_resumed, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # metrics.jsonl holds each step once: the resumed run dropped its stale rows past step 4.
  steps = [r['step'] for r in _read_metrics(resumed) if 'train/loss' in r]
  assert steps == [2, 4, 6, 8]


@pytest.mark.slow
@pytest.mark.parametrize('trainable,moving', [('mtp_heads', {0, 1}), ([2], {1})])
def test_frozen_parameters_do_not_move(trainable, moving):
  config = small_config()
  config.train.trainable = trainable
  mesh = sharding.make_mesh((1, 1), ('fsdp', 'model'))
  with jax.set_mesh(mesh):
    _, state, step_fn, _ = _setup(config, mesh)
    before = _params(state)
    it = recipe.make_data_iterator(config, 'train')
    for _ in range(2):
      state, _ = step_fn(state, sharding.put_batch(next(it), mesh))
  after = _params(state)
  for name in before:
    head = next((h for h in (0, 1) if f"['mtp_heads'][{h}]" in name), None)
    changed = not np.array_equal(before[name], after[name])
    assert changed == (head in moving), name
  # Frozen parameters carry no Adam moments.
  n_moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
  n_trainable = sum(v.size for k, v in after.items() if any(f"['mtp_heads'][{h}]" in k for h in moving))
  assert n_moments == 2 * n_trainable


def test_resolve_beta_defaults_and_schedules():
  config = small_config(num_mtp_heads=1)
  assert recipe.resolve_beta(config) == (1.0,)
  config = small_config(num_mtp_heads=4)
  assert recipe.resolve_beta(config) == (0.5,) * 4
  config.distill.beta = 1.0
  config.distill.beta_schedule = 'exp_decay'
  config.distill.step_gamma = 0.5
  assert recipe.resolve_beta(config) == (1.0, 0.5, 0.25, 0.125)
  config.distill.beta_schedule = 'linear_increase'
  assert recipe.resolve_beta(config) == (0.25, 0.5, 0.75, 1.0)
  config.distill.beta = (0.1, 0.2, 0.3, 0.4)
  assert recipe.resolve_beta(config) == (0.1, 0.2, 0.3, 0.4)
  config.distill.beta = (0.1, 0.2)
  with pytest.raises(ValueError, match='2 values for model.num_mtp_heads=4'):
    recipe.resolve_beta(config)


@pytest.mark.slow
@pytest.mark.parametrize('num_mtp_heads,distill', [(2, True), (2, False)])
def test_fused_chunked_loss_step_equals_the_logits_step(num_mtp_heads, distill):
  """train.loss_chunk_rows > 0 (loss from hidden states in row chunks) trains exactly as 0 does."""
  results = []
  for chunk_rows in (0, 32):
    config = small_config(num_mtp_heads=num_mtp_heads)
    config.distill.enabled = distill
    config.train.eps = 1e-3   # as in the mesh test: keep Adam's first update smooth in g
    config.train.loss_chunk_rows = chunk_rows
    mesh = sharding.make_mesh((1, 1), ('fsdp', 'model'))
    with jax.set_mesh(mesh):
      _, state, step_fn, _ = _setup(config, mesh)
      it = recipe.make_data_iterator(config, 'train')
      history = []
      for _ in range(3):
        state, metrics = step_fn(state, sharding.put_batch(next(it), mesh))
        history.append({k: float(v) for k, v in metrics.items()})
    results.append((history, _params(state)))
  (hist_a, params_a), (hist_b, params_b) = results
  for a, b in zip(hist_a, hist_b):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)
  for name in params_a:
    np.testing.assert_allclose(params_a[name], params_b[name], atol=1e-5, err_msg=name)


# Two steps of `tiny` from seed 0 on one device (the same on 8): a silent change of the model, the
# loss or the optimizer moves these by far more than float noise (values of commit 42ba739).
GOLDEN_TINY = [
    {'loss': 8.871158, 'xent': 5.958701, 'mtp/k1/xent': 5.98767, 'mtp/k4/xent': 5.988389,
     'distill/k1/kl': 0.552261, 'distill/k4/kl': 0.554194, 'grad_norm': 6.525299},
    {'loss': 8.886548, 'xent': 5.966081, 'mtp/k1/xent': 5.999749, 'mtp/k4/xent': 6.078642,
     'distill/k1/kl': 0.554549, 'distill/k4/kl': 0.561591, 'grad_norm': 6.537881},
]


def test_golden_first_steps_of_tiny():
  from configs import tiny
  config = tiny.get_config()
  mesh = sharding.make_mesh((1, 1, 1), ('data', 'fsdp', 'model'), devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    _, state, step_fn, _ = _setup(config, mesh)
    it = recipe.make_data_iterator(config, 'train')
    for want in GOLDEN_TINY:
      state, metrics = step_fn(state, sharding.put_batch(next(it), mesh))
      for key, value in want.items():
        assert float(metrics[key]) == pytest.approx(value, rel=2e-5, abs=1e-5), key
