"""The trunk-state cache: a heads-only step from it equals the step through the trunk; builds resume;
a cache of another model or data, a truncated file and a full disk are refused (an unfrozen trunk:
validation_test)."""

import functools
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from conftest import small_config
from mtpd_jax import train
from mtpd_jax.harness import recipe, training, trunk_cache

pytestmark = pytest.mark.reliability


def _config(tmp_path, **train_fields):
  config = small_config(num_mtp_heads=2, steps=6)
  config.train.update({'trainable': 'mtp_heads', 'trunk_cache': True, **train_fields})
  config.data.cache_dir = str(tmp_path / 'cache')
  return config


def _model(config):
  from mtpd_jax.model import MTPTransformer
  return MTPTransformer(recipe.model_config(config), rngs=nnx.Rngs(config.seed))


@pytest.mark.slow
@pytest.mark.parametrize('loss_chunk_rows', [0, 256])
def test_heads_only_step_from_the_cache_equals_the_step_through_the_trunk(tmp_path, loss_chunk_rows):
  config = _config(tmp_path, loss_chunk_rows=loss_chunk_rows)
  graphdef, params = nnx.split(_model(config), nnx.Param)
  batch = next(recipe.make_data_iterator(config, 'train'))
  hidden = nnx.merge(graphdef, params).trunk_hidden(batch['inputs'], batch['segment_ids'])
  labels = train.trainable_labels(params, 'mtp_heads')

  def loss(p, b):
    p = jax.tree.map(lambda x, l: x if l == 'train' else jax.lax.stop_gradient(x), p, labels)
    return train.forward_loss(p, graphdef, b, recipe.step_config(config), beta_scale=1.0)
  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (loss_a, (metrics_a, _)), grads_a = grad(params, batch)
  (loss_b, (metrics_b, _)), grads_b = grad(params, {**batch, 'trunk_hidden': np.asarray(hidden)})
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
  for k in metrics_a:
    np.testing.assert_allclose(metrics_a[k], metrics_b[k], rtol=1e-5, atol=1e-6, err_msg=k)
  heads_a, heads_b = grads_a['mtp_heads'], grads_b['mtp_heads']
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(heads_a)) > 1e-4  # the heads do learn
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7), heads_a, heads_b)


def _head_params(state):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in
          jax.tree_util.tree_leaves_with_path(state.params['mtp_heads'])}


@pytest.mark.slow
def test_training_from_the_cache_matches_training_through_the_trunk_and_reuses_the_cache(tmp_path):
  config = _config(tmp_path)
  state_a, final_a = training.train_and_evaluate(config, str(tmp_path / 'cached'), progress=False)
  plain = _config(tmp_path, trunk_cache=False)
  state_b, final_b = training.train_and_evaluate(plain, str(tmp_path / 'plain'), progress=False)
  for k in final_b:
    np.testing.assert_allclose(final_a[k], final_b[k], rtol=1e-4, atol=1e-6, err_msg=k)
  for name, value in _head_params(state_b).items():
    np.testing.assert_allclose(_head_params(state_a)[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
  # The cache holds every record of both splits, and another row of a sweep (plain MTP) reads it.
  (directory,) = [d for d in os.listdir(tmp_path / 'cache') if d.startswith('trunk-')]
  path = tmp_path / 'cache' / directory
  train_rows = len(recipe.make_source(config, 'train'))
  assert np.load(path / 'train.npy', mmap_mode='r').shape == (train_rows, 16, 32)
  assert (path / 'train.rows').read_text() == str(train_rows)
  stamp = os.stat(path / 'train.npy').st_mtime_ns
  other = _config(tmp_path)
  other.distill.enabled = False
  training.train_and_evaluate(other, str(tmp_path / 'mtp'), progress=False)
  assert [d for d in os.listdir(tmp_path / 'cache') if d.startswith('trunk-')] == [directory]
  assert os.stat(path / 'train.npy').st_mtime_ns == stamp


@pytest.mark.slow
def test_a_run_from_the_cache_resumes_to_the_uninterrupted_result(tmp_path):
  """Resuming opens the cache before the restored data iterator (which prefetches at once) reads."""
  config = _config(tmp_path)  # checkpoints at 3 and 6
  config.ckpt.every_steps = 3
  whole, resumed = str(tmp_path / 'whole'), str(tmp_path / 'resumed')
  whole_state, want = training.train_and_evaluate(config, whole, progress=False)
  shutil.copytree(whole, resumed)  # a run killed after its step-3 checkpoint
  shutil.rmtree(os.path.join(resumed, 'checkpoints', '6'))
  state, got = training.train_and_evaluate(config, resumed, progress=False)
  assert int(state.step) == 6 and got == want
  for name, value in _head_params(whole_state).items():
    np.testing.assert_array_equal(_head_params(state)[name], value, err_msg=name)


def _build(config, *, sources=None):
  graphdef, params = nnx.split(_model(config), nnx.Param)
  cache = recipe.make_trunk_cache(config)
  sources = sources or {s: recipe.make_source(config, s) for s in trunk_cache.SPLITS}
  cache.build(graphdef, params, sources)
  return cache, graphdef, params


class _Interrupted(Exception):
  pass


class _StopAfter:
  """A record source that fails at record `stop` (a build killed partway)."""

  def __init__(self, source, stop):
    self.source, self.stop = source, stop

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    if i >= self.stop:
      raise _Interrupted
    return self.source[i]


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_an_interrupted_build_continues_and_the_states_are_the_trunks(tmp_path, dtype):
  config = _config(tmp_path, trunk_cache_dtype=dtype)
  source = recipe.make_source(config, 'train')
  with pytest.raises(_Interrupted):
    _build(config, sources={'train': _StopAfter(source, 20)})
  cache, graphdef, params = _build(config, sources={'train': source})
  assert (open(os.path.join(cache.directory, 'train.rows')).read()) == str(len(source))
  states = cache.states('train')
  assert states.dtype == (ml_dtypes.bfloat16 if dtype == 'bfloat16' else np.float32)
  model = nnx.merge(graphdef, params)
  for rows in (slice(0, 8), slice(16, 24), slice(len(source) - 8, len(source))):  # both sides of the cut
    records = [source[i] for i in range(len(source))[rows]]
    want = model.trunk_hidden(np.stack([r['inputs'] for r in records]), np.stack([r['segment_ids'] for r in records]))
    want = np.asarray(want).astype(ml_dtypes.bfloat16) if dtype == 'bfloat16' else want
    tol = 2**-7 if dtype == 'bfloat16' else 1e-5  # one bf16 ulp: float noise may round to a neighbour
    np.testing.assert_allclose(np.asarray(states[rows], np.float32), np.asarray(want, np.float32), rtol=tol, atol=1e-5)


def test_a_cache_of_another_model_or_data_is_refused_and_kept(tmp_path):
  named = tmp_path / 'mine'
  config = _config(tmp_path, trunk_cache_dir=str(named))
  _build(config)
  before = sorted(os.listdir(named))
  other = _config(tmp_path, trunk_cache_dir=str(named))
  other.seed = 1  # another trunk
  with pytest.raises(trunk_cache.TrunkCacheError, match='another model or data .*the trunk parameters'):
    _build(other)
  other = _config(tmp_path, trunk_cache_dir=str(named))
  other.data.seq_len = 8
  with pytest.raises(trunk_cache.TrunkCacheError, match='data.seq_len'):
    _build(other)
  assert sorted(os.listdir(named)) == before


def test_a_truncated_cache_file_is_refused(tmp_path):
  config = _config(tmp_path)
  cache, _, _ = _build(config)
  path = os.path.join(cache.directory, 'train.npy')
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(trunk_cache.TrunkCacheError, match='train.npy is truncated; delete'):
    _build(config)


def test_a_full_disk_is_refused_before_writing(tmp_path, monkeypatch):
  config = _config(tmp_path)
  monkeypatch.setattr(shutil, 'disk_usage', lambda _: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1 << 20))  # pylint: disable=protected-access
  with pytest.raises(trunk_cache.TrunkCacheError, match='GiB free; free space'):
    _build(config)
  directory = os.path.join(tmp_path, 'cache', os.listdir(tmp_path / 'cache')[0])
  assert os.listdir(directory) == ['meta.json']


@pytest.mark.slow
def test_every_looped_stage_reads_the_one_cache_of_the_frozen_trunk(tmp_path):
  from mtpd_jax.harness import looped
  config = _config(tmp_path)
  config.looped.schedule, config.looped.stage_steps = (1, 2), 2
  state, _ = looped.run_looped(config, str(tmp_path / 'looped'), progress=False)
  assert len(state.params['mtp_heads']) == 2
  assert len([d for d in os.listdir(tmp_path / 'cache') if d.startswith('trunk-')]) == 1
