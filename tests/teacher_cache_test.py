"""Heads over a head vocabulary on a frozen trunk: the cached teacher gives the on-the-fly loss, a
changed trunk, Top-N or data builds another, a killed build resumes, a damaged file is named; the
ids are saved with every checkpoint, and a resume, a warm start or an evaluation that would use
other ids is refused."""

import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import small_config
from mtpd_jax import train
from mtpd_jax.harness import experiment, recipe, training, trunk_cache

pytestmark = pytest.mark.reliability


def _config(tmp_path, **fields):
  config = small_config(num_mtp_heads=2, steps=6)
  config.train.update({'trainable': 'mtp_heads', 'trunk_cache': True, 'teacher_cache': True})
  config.mtp.head_vocab = 16
  config.data.cache_dir = str(tmp_path / 'cache')
  config.update_from_flattened_dict(fields)
  return config


def _model_params(config):
  from mtpd_jax.model import MTPTransformer
  return nnx.split(MTPTransformer(recipe.model_config(config), rngs=nnx.Rngs(config.seed)), nnx.Param)


def _build(config, sources=None):
  graphdef, params = _model_params(config)
  cache = recipe.make_trunk_cache(config)
  cache.build(graphdef, params, sources or {s: recipe.make_source(config, s) for s in trunk_cache.SPLITS},
              progress=False)
  return cache, graphdef, params


def test_the_loss_from_the_teacher_cache_equals_the_loss_computed_on_the_fly(tmp_path):
  config = _config(tmp_path)
  cache, graphdef, params = _build(config)
  batch = next(recipe.make_data_iterator(config, 'train', cache))
  assert batch['teacher_idx'].shape == (8, 16, 8) and batch['teacher_idx'].dtype == np.int32
  labels = train.trainable_labels(params, 'mtp_heads')
  step = recipe.step_config(config, recipe.head_vocab_ids(config))

  def loss(p, b):
    p = jax.tree.map(lambda x, l: x if l == 'train' else jax.lax.stop_gradient(x), p, labels)
    return train.forward_loss(p, graphdef, b, step, beta_scale=1.0)
  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (cached, (m_cached, _)), g_cached = grad(params, batch)
  fly = {k: v for k, v in batch.items() if not k.startswith('teacher_')}
  (want, (m_want, _)), g_want = grad(params, fly)
  np.testing.assert_allclose(cached, want, rtol=1e-5)
  assert set(m_cached) == set(m_want) and m_want['distill/k2/kl'] > 0
  for k in m_want:
    np.testing.assert_allclose(m_cached[k], m_want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7),
               g_cached['mtp_heads'], g_want['mtp_heads'])


def _dirs(tmp_path, prefix):
  return sorted(d for d in os.listdir(tmp_path / 'cache') if d.startswith(prefix) and '.teacher-' not in d)


def _teachers(tmp_path):
  return sorted(d for d in os.listdir(tmp_path / 'cache') if '.teacher-' in d)


def test_a_changed_trunk_top_n_or_data_builds_another_teacher_cache_and_the_same_one_is_reused(tmp_path):
  first, _, _ = _build(_config(tmp_path))
  stamp = os.stat(os.path.join(first.teacher.directory, 'train.logp.npy')).st_mtime_ns
  again, _, _ = _build(_config(tmp_path, **{'distill.enabled': False}))  # the MTP row reads the same one
  assert again.teacher.directory == first.teacher.directory
  assert os.stat(os.path.join(first.teacher.directory, 'train.logp.npy')).st_mtime_ns == stamp
  _build(_config(tmp_path, **{'distill.top_n': 4}))  # another N: the trunk states stay
  assert len(_dirs(tmp_path, 'trunk-')) == 1 and len(_teachers(tmp_path)) == 2
  _build(_config(tmp_path, seed=1))  # another trunk
  _build(_config(tmp_path, **{'data.seq_len': 8}))  # other records
  assert len(_dirs(tmp_path, 'trunk-')) == 3 and len(_teachers(tmp_path)) == 4


class _Killed(Exception):
  pass


class _KillAfter:
  """A record source that fails at record `stop`: a build killed partway."""

  def __init__(self, source, stop):
    self.source, self.stop = source, stop

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    if i >= self.stop:
      raise _Killed
    return self.source[i]


def test_a_killed_teacher_build_is_never_read_as_complete_and_resumes_to_the_whole_build(tmp_path):
  config = _config(tmp_path)
  sources = {s: recipe.make_source(config, s) for s in trunk_cache.SPLITS}
  graphdef, params = _model_params(config)
  cache = recipe.make_trunk_cache(config)
  cache.build(graphdef, params, sources, progress=False)  # trunk and teacher, whole
  whole = {name: np.array(cache.teacher._files.array('train', name)) for name in ('idx', 'logp', 'argmax')}
  killed = _config(tmp_path, **{'data.cache_dir': str(tmp_path / 'other')})
  trunk_only = _config(tmp_path, **{'data.cache_dir': str(tmp_path / 'other'), 'train.teacher_cache': False})
  recipe.make_trunk_cache(trunk_only).build(graphdef, params, sources, progress=False)
  cache = recipe.make_trunk_cache(killed)  # its trunk states are complete: the kill falls in the teacher's build
  with pytest.raises(_Killed):
    cache.build(graphdef, params, {**sources, 'train': _KillAfter(sources['train'], 20)}, progress=False)
  rows = int(open(os.path.join(cache.teacher.directory, 'train.rows')).read())
  assert 0 < rows < len(sources['train'])  # what a later run reads: not complete
  cache = recipe.make_trunk_cache(killed)
  cache.build(graphdef, params, sources, progress=False)
  assert int(open(os.path.join(cache.teacher.directory, 'train.rows')).read()) == len(sources['train'])
  for name, want in whole.items():
    np.testing.assert_allclose(cache.teacher._files.array('train', name), want, rtol=1e-6, err_msg=name)


def test_a_damaged_teacher_file_is_named_in_one_line(tmp_path):
  config = _config(tmp_path)
  cache, _, _ = _build(config)
  path = os.path.join(cache.teacher.directory, 'train.logp.npy')
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(trunk_cache.TrunkCacheError, match='teacher cache file .*train.logp.npy is truncated; delete'):
    _build(config)


@pytest.mark.slow
def test_head_vocabulary_ids_travel_with_the_checkpoints_and_other_ids_are_refused(tmp_path, monkeypatch):
  config = _config(tmp_path, **{'ckpt.every_steps': 3})
  workdir = str(tmp_path / 'run')
  training.train_and_evaluate(config, workdir, progress=False)
  ids = recipe.head_vocab_ids(config)
  np.testing.assert_array_equal(training.head_vocab_of(workdir, config), ids)
  # The decoding evaluation drafts among exactly those ids.
  seen = {}

  def evaluate_prompt_sets(model, sets, opts, **kw):
    seen['draft_vocab'] = np.asarray(opts.draft.vocab)
    raise _Killed  # what it was given is all this test reads
  monkeypatch.setattr(experiment.evaluate, 'evaluate_prompt_sets', evaluate_prompt_sets)
  with pytest.raises(_Killed):
    experiment.evaluate_workdir(workdir, write=False)
  np.testing.assert_array_equal(seen['draft_vocab'], ids)
  # A resume (a longer run) whose data now gives other ids is refused, and its checkpoints stay.
  monkeypatch.setattr(recipe, 'head_vocab_ids', lambda c: np.roll(ids, 1) if c.mtp.head_vocab else None)
  longer = _config(tmp_path, **{'ckpt.every_steps': 3, 'train.steps': 9})
  with pytest.raises(ValueError, match=r'checkpoint 6 in .* was saved with another head_vocab \(head_vocab: 16 ids'):
    training.train_and_evaluate(longer, workdir, progress=False)
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['3', '6']
  # So is a warm start of new heads from it (a looped stage) that would draft other ids.
  stage = _config(tmp_path, **{'train.init_from': workdir, 'train.init_heads': 'loop', 'model.num_mtp_heads': 3})
  with pytest.raises(ValueError, match='train.init_from=.* was saved with another head_vocab'):
    training.train_and_evaluate(stage, str(tmp_path / 'stage'), progress=False)


@pytest.mark.slow
def test_a_config_with_a_head_vocabulary_needs_one_in_its_checkpoint(tmp_path):
  config = _config(tmp_path, **{'mtp.head_vocab': 0, 'train.teacher_cache': False})
  workdir = str(tmp_path / 'run')
  training.train_and_evaluate(config, workdir, progress=False)
  assert training.head_vocab_of(workdir, config) is None
  with pytest.raises(ValueError, match='holds no head vocabulary'):
    training.head_vocab_of(workdir, _config(tmp_path))
