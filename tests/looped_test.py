"""Warm starts and the trained looped extension: copies, frozen groups, stage resumption."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import small_config
from mtpd_jax import runtime
from mtpd_jax.harness import looped, recipe, training
from mtpd_jax.model import MTPTransformer


def _params(num_mtp_heads, seed):
  cfg = recipe.model_config(small_config(num_mtp_heads=num_mtp_heads))
  return nnx.state(MTPTransformer(cfg, rngs=nnx.Rngs(seed)), nnx.Param)


def test_transplant_copies_the_trunk_and_loops_heads():
  src, dst = _params(2, seed=0), _params(5, seed=1)
  out = training.transplant(dst, src, loop_heads=True)
  np.testing.assert_array_equal(out['embed'][...], src['embed'][...])
  for j, from_head in enumerate([0, 1, 0, 1, 0]):   # head j+1 <- source head ((j) mod 2)+1
    np.testing.assert_array_equal(out['mtp_heads'][j]['proj'][...], src['mtp_heads'][from_head]['proj'][...])
  fresh = training.transplant(dst, src, loop_heads=False)
  np.testing.assert_array_equal(fresh['mtp_heads'][4]['proj'][...], dst['mtp_heads'][4]['proj'][...])
  with pytest.raises(ValueError, match='has shape'):
    cfg = small_config()
    cfg.model.dim = 48
    training.transplant(nnx.state(MTPTransformer(recipe.model_config(cfg), rngs=nnx.Rngs(0)), nnx.Param),
                     src, loop_heads=True)


@pytest.mark.slow
def test_looped_stages_train_only_the_new_heads(tmp_path):
  config = small_config(num_mtp_heads=1, steps=4)
  config.looped.schedule = (1, 3)
  config.looped.stage_steps = 4
  stages = looped.stage_configs(config, str(tmp_path))
  assert [c.model.num_mtp_heads for c, _ in stages] == [1, 3]
  assert stages[1][0].train.trainable == [2, 3] and stages[1][0].train.init_heads == 'loop'
  looped.run_looped(config, str(tmp_path), progress=False)
  first, _ = training.restore_model(str(tmp_path / 'heads_1'))
  last, last_config = training.restore_model(str(tmp_path / 'heads_3'))
  assert last_config.model.num_mtp_heads == 3
  p1, p3 = nnx.state(first, nnx.Param), nnx.state(last, nnx.Param)
  for path, leaf in jax.tree_util.tree_leaves_with_path(p1):   # trunk and head 1 frozen
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(dict(jax.tree_util.tree_leaves_with_path(p3))[path]))
  # Heads 2 and 3 started as copies of head 1 and then trained.
  for j in (1, 2):
    assert not np.array_equal(p3['mtp_heads'][j]['proj'][...], p1['mtp_heads'][0]['proj'][...])
  # A rerun finds both stages finished and changes nothing.
  looped.run_looped(config, str(tmp_path), progress=False)
  again, _ = training.restore_model(str(tmp_path / 'heads_3'))
  np.testing.assert_array_equal(nnx.state(again, nnx.Param)['mtp_heads'][2]['proj'][...],
                                p3['mtp_heads'][2]['proj'][...])


@pytest.mark.slow
@pytest.mark.reliability
def test_an_interrupted_looped_stage_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
  config = small_config(num_mtp_heads=1, steps=4)
  config.looped.schedule, config.looped.stage_steps = (1, 2), 4
  config.ckpt.every_steps = 100  # only the preemption and the final step save
  looped.run_looped(config, str(tmp_path / 'straight'), progress=False)
  calls = {'n': 0}

  def preempt_at_stage_2_step_2(self):
    calls['n'] += 1
    self.signum = self.signum or (15 if calls['n'] == 6 else None)  # stage 1: calls 1-4
    return self.signum is not None
  monkeypatch.setattr(runtime.PreemptionGuard, 'requested', preempt_at_stage_2_step_2)
  with pytest.raises(runtime.Preempted):
    looped.run_looped(config, str(tmp_path / 'cut'), progress=False)
  assert sorted(os.listdir(tmp_path / 'cut' / 'heads_2' / 'checkpoints')) == ['2']
  monkeypatch.undo()
  looped.run_looped(config, str(tmp_path / 'cut'), progress=False)
  a, _ = training.restore_model(str(tmp_path / 'straight' / 'heads_2'))
  b, _ = training.restore_model(str(tmp_path / 'cut' / 'heads_2'))
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(nnx.state(a, nnx.Param)),
                          jax.tree.leaves(nnx.state(b, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
