"""Exported heads: a short head-training run, exported as safetensors and reloaded into a fresh run,
gives bitwise the same logits; a tampered mtp_config.json (another base, other draft ids) is refused."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import small_config
from mtpd_jax.harness import export, training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # two short trainings and a subprocess


def _config(tmp_path, **fields):
  config = small_config(num_mtp_heads=2, steps=4)
  config.model.qk_norm = False
  config.data.cache_dir = str(tmp_path / 'cache')
  config.update_from_flattened_dict(fields)
  return config


def _logits(state, tokens):
  out = nnx.merge(state.graphdef, state.params)(tokens)
  return np.asarray(out.logits_BxTxV), np.asarray(out.mtp_logits_KxBxTxV)


def test_exported_heads_reload_bitwise_and_a_tampered_config_is_refused(tmp_path):
  base = str(tmp_path / 'base')
  training.train_and_evaluate(_config(tmp_path, **{'model.num_mtp_heads': 0, 'eval.enabled': False}), base, progress=False)
  heads = _config(tmp_path, **{'train.init_from': base, 'train.trainable': 'mtp_heads', 'mtp.head_vocab': 16})
  trained, _ = training.train_and_evaluate(heads, str(tmp_path / 'heads'), progress=False)
  out = tmp_path / 'export'
  proc = subprocess.run([sys.executable, '-m', 'experiments.export', f'--workdir={tmp_path / "heads"}', f'--out={out}'],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert 'checkpoint_manager' not in proc.stderr  # orbax's INFO lines are not the user's output
  mode = lambda name: os.stat(out / name).st_mode & 0o777
  umask = os.umask(0)
  os.umask(umask)
  assert mode(export.WEIGHTS) == mode(export.CONFIG) == 0o666 & ~umask  # as open() creates files, not private
  meta = json.loads((out / export.CONFIG).read_text())
  assert meta['num_mtp_heads'] == 2 and meta['base']['init_from'] == base and len(meta['head_vocab']) == 16
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  with safe_open(str(out / export.WEIGHTS), framework='numpy') as f:
    names = set(f.keys())
  assert {'model.layers.2.enorm.weight', 'model.layers.2.hnorm.weight', 'model.layers.3.eh_proj.weight',
          'model.layers.2.self_attn.q_proj.weight', 'model.layers.3.mlp.down_proj.weight'} <= names
  # A fresh run from the exported folder: the base's trunk and the exported heads, bitwise.
  fresh = _config(tmp_path, **{'train.init_from': str(out), 'train.trainable': 'mtp_heads', 'mtp.head_vocab': 16})
  mesh = jax.make_mesh((1,), ('data',))
  abstract, shardings = training.abstract_state(fresh, mesh)
  with jax.set_mesh(mesh):
    reloaded = training.warm_start(fresh, abstract, shardings, mesh=mesh)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 16), dtype=np.int32)
  for got, want in zip(_logits(reloaded, tokens), _logits(trained, tokens)):
    np.testing.assert_array_equal(got, want)
  # Tampered: another base model's hash, then other draft ids.
  for change, message in (({'base': {**meta['base'], 'trunk_sha256': '0' * 64}}, 'trained on another base model'),
                          ({'head_vocab': meta['head_vocab'][::-1][:8]}, 'they must be the same ids')):
    (out / export.CONFIG).write_text(json.dumps({**meta, **change}))
    with pytest.raises(ValueError, match=message), jax.set_mesh(mesh):
      training.warm_start(fresh, abstract, shardings, mesh=mesh)
