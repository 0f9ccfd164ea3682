"""Every config file builds, every sweep key exists, bad values are refused with a clear message."""

import glob
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import run as run_cli
from mtpd_jax import model, sharding
from mtpd_jax.harness import experiment, recipe, training, validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(p for p in glob.glob(os.path.join(ROOT, 'configs', '**', '*.py'), recursive=True)
                      if not os.path.basename(p).startswith('_'))


def _load(path):
  spec = importlib.util.spec_from_file_location('cfg_' + os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize('path', CONFIG_FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_config_builds_and_every_sweep_point_applies(path):
  module = _load(path)
  if not hasattr(module, 'get_config'):
    pytest.skip('not a config module')
  variants = [''] + ([a for a in ('quick', 'cpu') if _has_variant(module, a)]
                      if 'arg' in inspect.signature(module.get_config).parameters else [])
  for arg in variants:
    _check_sweep(module, arg)


def _has_variant(module, arg: str) -> bool:
  try:
    module.get_config(arg)
  except ValueError:  # "unknown config argument"
    return False
  return True


def _check_sweep(module, arg: str) -> None:
  sweep = run_cli.load_sweep(module.__file__ + (':' + arg if arg else ''))
  points = experiment.sweep_points(sweep)
  assert points, 'get_sweep() returned no points'
  assert len({label for label, _ in points}) == len(points), 'two points share a label'
  experiment.references(sweep)  # every named reference is a row
  for _, point in points:
    config = module.get_config(arg) if arg else module.get_config()
    config.lock()
    config.update_from_flattened_dict(point)  # raises on a key that does not exist
    validation.validate_config(config)
    model_cfg = recipe.model_config(config)
    if model_cfg not in _COUNTED:  # the points of a sweep mostly share their model
      _COUNTED.add(model_cfg)
      mesh = sharding.make_mesh((1, 1, 1), ('data', 'fsdp', 'model'))
      abstract, _ = training.abstract_state(config, mesh)
      assert sum(x.size for x in jax.tree.leaves(abstract.params)) == model.param_count(model_cfg)


_COUNTED = set()  # model configs whose built parameter count was checked against model.param_count


@pytest.mark.parametrize('field,value,message', [
    ('distill.kl', 'sideways', "distill.kl='sideways' must be one of ('forward', 'reverse')"),
    ('distill.divergence', 'hellinger', "distill.divergence='hellinger' must be one of ('kl', 'tv', 'js')"),
    ('distill.top_n', 0, 'distill.top_n=0 must be None or an int'),
    ('distill.top_n', 10 ** 6, 'must be None or an int in'),
    ('model.num_mtp_heads', -1, 'model.num_mtp_heads=-1 must be an int >= 0'),
    ('distill.beta', (0.1, 0.2), 'must be one value per head: 4 values for model.num_mtp_heads=4'),
    ('distill.beta', -0.5, 'distill.beta=-0.5 must be None or a finite number >= 0'),
    ('distill.teacher', 'oracle', 'distill.teacher'),
    ('train.trainable', [9], 'train.trainable=[9] must be'),
    ('data.seq_len', 10 ** 5, 'data.seq_len=100000 must be an int in [1, model.max_seq_len=32]'),
    ('eval.draft_vocab', -1, 'eval.draft_vocab=-1 must be an int in [0, model.vocab_size='),
    ('eval.draft_vocab', 10 ** 6, 'eval.draft_vocab=1000000 must be an int in'),
    ('eval.tree', (2, 0), 'eval.tree=(2, 0) must be a tuple of branchings >= 1'),
    ('eval.tree', (2, 2), 'eval.tree=(2, 2) has 2 depths, but decoding drafts 4'),
    ('eval.draft_min_prob', 1.5, 'eval.draft_min_prob=1.5 must be a finite number in [0, 1]'),
    ('eval.draft_source', 'lookup', "eval.draft_source='lookup' must be one of ('heads', 'context', 'both')"),
    ('eval.ngram', 0, 'eval.ngram=0 must be an int >= 1'),
])
def test_bad_values_are_refused(field, value, message):
  from conftest import small_config
  config = small_config(num_mtp_heads=4)
  config.update_from_flattened_dict({field: value})
  with pytest.raises(ValueError, match=re.escape(message)):
    validation.validate_config(config)


@pytest.mark.parametrize('overrides,message', [
    ({'eval.draft_source': 'both', 'eval.tree': (2, 1, 1, 1)}, "eval.draft_source='both' drafts chains from the context, "
     'without a tree (eval.tree)'),
    ({'eval.draft_source': 'context', 'eval.draft_min_prob': 0.5}, 'without a tree (or eval.draft_min_prob)')])
def test_context_drafts_with_a_tree_or_adaptive_depth_are_refused(overrides, message):
  from conftest import small_config
  config = small_config(num_mtp_heads=4)
  config.update_from_flattened_dict(overrides)
  with pytest.raises(ValueError, match=re.escape(message)):
    validation.validate_config(config)


def test_a_symmetric_divergence_with_a_kl_direction_is_refused():
  from conftest import small_config
  config = small_config(num_mtp_heads=1)
  config.update_from_flattened_dict({'distill.divergence': 'js', 'distill.kl': 'reverse'})
  with pytest.raises(ValueError, match=re.escape("kl='reverse' is a direction of the KL; divergence='js' is symmetric")):
    validation.validate_config(config)
  config.distill.kl = 'forward'
  validation.validate_config(config)


def test_cli_refuses_bad_input_with_one_line_and_exit_2(tmp_path):
  env = {**os.environ, 'JAX_NUM_CPU_DEVICES': '1'}
  for args, message in (
      (['--config=no_such_config'], 'config file'),
      (['--config=tiny', '--config.distill.kl=sideways', f'--workdir={tmp_path}'], 'distill.kl'),
  ):
    proc = subprocess.run([sys.executable, '-m', 'experiments.run', *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_draft_and_head_vocabularies_are_the_most_frequent_training_tokens():
  from conftest import small_config
  config = small_config(num_mtp_heads=1)
  config.data.synthetic_records = 64
  ids = recipe.frequent_training_tokens(config, 8)
  source = recipe.make_source(config, 'train')
  counts = np.bincount(np.concatenate([source[i]['inputs'] for i in range(len(source))]))
  assert len(ids) == 8 and np.all(np.diff(ids) > 0)
  assert counts[ids].min() >= np.delete(counts, ids).max()
  config.mtp.head_vocab = 8
  np.testing.assert_array_equal(recipe.head_vocab_ids(config), ids)
