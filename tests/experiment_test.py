"""The paper's configs end to end at their `:quick` size: embedded data, cached base model, every
variant, real decoding, the report; and a rerun skips finished points.

`make test` (CI) runs two of the six points of `ablation_topn:quick` (`--sweep_index`): Top-N = 1
(the CE-only baseline, through the distillation code) and the default. Every config's whole quick
sweep takes minutes, so those tests carry the `sweeps` marker, which pytest.ini deselects by
default: `pytest -m sweeps` runs them, ablation_topn's included.
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ('ablation_topn', 'mtp_vs_mtpd', 'ablation_detach', 'ablation_beta', 'ablation_kl', 'ablation_step_weights',
           'ablation_ensemble', 'ablation_divergence', 'looped', 'looped_deep')
sys.path.insert(0, ROOT)
from experiments import run as run_cli  # noqa: E402


@pytest.fixture(scope='module')
def shared_env(tmp_path_factory):
  """One data cache for the module (and conftest's XLA cache for the suite): later configs reuse
  what earlier ones built."""
  return {**os.environ, 'JAX_NUM_CPU_DEVICES': '1', 'PYTHONPATH': ROOT,
          'MTPD_JAX_CACHE': str(tmp_path_factory.mktemp('cache'))}


def _run(args, cwd, env, timeout=900):
  proc = subprocess.run([sys.executable, '-m', 'experiments.run', *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _expected_depth(name: str, point: dict) -> int:
  """The draft depth a point's report should have: its eval.draft_depth, else its last head count."""
  config = run_cli.load_config_module(os.path.join(ROOT, 'configs', name + '.py')).get_config('quick')
  config.update_from_flattened_dict(point)
  schedule = tuple(config.looped.schedule)
  return config.eval.draft_depth or (schedule[-1] if schedule else config.model.num_mtp_heads)


def check_quick_sweep(name: str, tmp_path, env, indices=None) -> dict:
  """Run NAME:quick (or its points `indices`) and check its report: every row that ran decoded
  losslessly to its depth, with sane rates, and the others are empty."""
  workdir = tmp_path / 'runs' / name
  only = [f'--sweep_index={",".join(map(str, indices))}'] if indices else []
  _run([f'--config={name}:quick', f'--workdir={workdir}', *only], tmp_path, env)
  results_dir = workdir / 'report'  # a run given --workdir keeps its report there
  report = (results_dir / 'results.md').read_text()
  for image in ('acceptance.png', 'loss_curves.png'):
    assert (results_dir / image).stat().st_size > 0
  results = json.loads((results_dir / 'results.json').read_text())['rows']
  points = run_cli.load_sweep(os.path.join(ROOT, 'configs', name + '.py'))
  assert list(results) == [p['label'] for p in points]
  for i, point in enumerate(points):
    label = point['label']
    if indices and i not in indices:
      assert results[label] == [] and f'| {label} | – ' in report, label
      continue
    assert f'| {label} |' in report and f'| {label} | – ' not in report, label
    (run,) = results[label]
    depth = _expected_depth(name, {k: v for k, v in point.items() if k != 'label'})
    assert set(run['eval']['prompt_sets']) == {'chat', 'code', 'math'}
    for result in run['eval']['prompt_sets'].values():
      assert result['lossless'] is True, label
      assert result['draft_depth'] == depth and len(result['ar']) == depth, label
      # AR at depth k is undefined (NaN, null in JSON) where no step accepted k-1 drafts.
      assert all(a is None or math.isnan(a) or 0.0 <= a <= 1.0 for a in result['ar']), label
      car = result['car']
      assert all(b <= a + 1e-12 for a, b in zip(car, car[1:])), label  # cumulative: never rises
      assert result['tokens_per_forward'] == pytest.approx(1.0 + sum(car))
    assert 0.0 < run['eval']['heldout']['accuracy'] < 1.0
  return results


@pytest.mark.slow
def test_ablation_topn_quick_points_and_rerun(tmp_path, shared_env):
  results = check_quick_sweep('ablation_topn', tmp_path, shared_env, indices=[1, 3])
  # Every variant continued from one cached base model.
  assert len(os.listdir(tmp_path / 'runs' / '_base')) == 1
  # Top-N = 1 is the CE-only baseline: the renormalised KL over one logit is zero, and so is its gradient.
  assert results['Top N = 1'][0]['final']['eval/distill/k1/kl'] == 0.0
  # A rerun of points that ran finds them finished and only rewrites the report.
  again = _run(['--config=ablation_topn:quick', f'--workdir={tmp_path / "runs" / "ablation_topn"}',
                '--sweep_index=3,1'], tmp_path, shared_env, timeout=300)
  assert 'finished earlier' in again.stdout and '[base]' not in again.stdout


@pytest.mark.slow
@pytest.mark.sweeps
@pytest.mark.parametrize('name', CONFIGS)
def test_paper_config_quick_sweep(name, tmp_path, shared_env):
  results = check_quick_sweep(name, tmp_path, shared_env)
  if name.startswith('looped'):  # trained loops end in their last stage's workdir
    for label, (run,) in results.items():
      if 'trained' in label:
        assert os.path.basename(run['model_dir']).startswith('heads_'), label


def test_a_fixed_base_seed_gives_every_seed_one_base_model_and_keeps_the_variants_seeds():
  from configs import base
  from mtpd_jax.harness import experiment
  c = base.get_config()
  c.base.steps = 10
  own = [experiment.with_base(experiment.with_seed(c, i)).train.init_from for i in range(3)]
  c.base.seed = 0
  fixed = [experiment.with_base(experiment.with_seed(c, i)) for i in range(3)]
  assert len(set(own)) == 3 and {f.train.init_from for f in fixed} == {own[0]}  # seed 0's own base, reused
  assert [(f.seed, f.data.seed) for f in fixed] == [(0, 0), (1, 1), (2, 2)]  # the variants still vary
  base_lm = experiment.base_config(fixed[2])
  assert (base_lm.seed, base_lm.data.seed, base_lm.model.num_mtp_heads) == (0, 0, 0)


def _small_looped_sweep(tmp_path):
  from conftest import small_config
  c = small_config(num_mtp_heads=1, steps=4)
  c.looped.stage_steps = 4
  c.eval.update(dict(max_prompts=2, max_new_tokens=8, repeats=1, timing_steps=4, timing_repeats=1))
  sweep = [{'label': 'K=1'}, {'label': 'free', 'eval.draft_depth': 3},
           {'label': 'loop', 'looped.schedule': (1, 2)}, {'label': 'loop, MTP', 'looped.schedule': (1, 2),
                                                          'distill.enabled': False}]
  return c, sweep


def test_points_that_train_alike_share_one_model_and_a_loop_continues_from_it(tmp_path):
  from mtpd_jax.harness import experiment
  c, sweep = _small_looped_sweep(tmp_path)
  points = []
  for i, (_, overrides) in enumerate(experiment.sweep_points(sweep)):
    p = experiment.with_seed(c, 0)
    p.update_from_flattened_dict(overrides)
    points.append((p, str(tmp_path / str(i))))
  plans = experiment.training_plans(points, str(tmp_path))
  dirs = [[d for _, d in plan] for plan in plans]
  d = lambda *parts: str(tmp_path.joinpath(*parts))
  # Only the evaluation differs: one model. The loop's first stage is row 0's; its copies continue from it.
  assert dirs == [[d('0')], [d('0')], [d('0'), d('2', 'heads_2')], [d('3', 'heads_1'), d('3', 'heads_2')]]
  assert plans[2][1][0].train.init_from == d('0') and plans[2][1][0].train.trainable == [2]
  assert plans[3][1][0].train.init_from == d('3', 'heads_1')  # MTP trains another model
  # A point's own checkpoints (from before models were shared) keep their place.
  os.makedirs(tmp_path / '2' / 'heads_1' / 'checkpoints' / '4')
  again = experiment.training_plans(points, str(tmp_path))
  assert [d for _, d in again[2]] == [d('2', 'heads_1'), d('2', 'heads_2')]


@pytest.mark.slow
def test_a_sweep_trains_a_shared_model_once_and_evaluates_each_row_its_own_way(tmp_path, capsys):
  import jax
  import numpy as np
  from flax import nnx
  from mtpd_jax.harness import experiment, training
  c, sweep = _small_looped_sweep(tmp_path)
  sweep = sweep[:3]
  workdir = tmp_path / 'sweep'
  experiment.run_sweep(c, sweep, str(workdir), str(tmp_path / 'report'), root=str(tmp_path), progress=False)
  out = capsys.readouterr().out
  assert out.count('[shared]') == 2 and not (workdir / '1' / 'checkpoints').exists()
  assert not (workdir / '2' / 'heads_1').exists()
  rows = json.loads((tmp_path / 'report' / 'results.json').read_text())['rows']
  depth = lambda label: {r['draft_depth'] for r in rows[label][0]['eval']['prompt_sets'].values()}
  assert (depth('K=1'), depth('free'), depth('loop')) == ({1}, {3}, {2})
  assert rows['free'][0]['model_dir'] == rows['K=1'][0]['model_dir'] == str(workdir / '0')
  for i, label in enumerate(('K=1', 'free', 'loop')):  # each row's own report, in its own workdir
    saved = json.loads((workdir / str(i) / 'eval.json').read_text())
    assert {r['draft_depth'] for r in saved['prompt_sets'].values()} == depth(label)
  # The loop trained alone (its first stage in its own workdir) ends in the same model.
  loop = experiment.with_seed(c, 0)
  loop.looped.schedule = (1, 2)
  loop.eval.enabled = False  # only its parameters are compared
  alone = experiment.run_point(loop, str(tmp_path / 'alone'), root=str(tmp_path), progress=False)
  assert (tmp_path / 'alone' / 'heads_1' / 'checkpoints').is_dir()
  a, _ = training.restore_model(rows['loop'][0]['model_dir'])
  b, _ = training.restore_model(alone['model_dir'])
  for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
