"""The speculation planner: its candidates, its choice from measured costs and acceptance, its cost
cache, and that its pick decodes losslessly."""

import dataclasses

import numpy as np
import pytest

from benchmarks import tiny_heads
from mtpd_jax import decode
from mtpd_jax.drafting import DraftPlan
from mtpd_jax.harness import evaluate, planner
from mtpd_jax.model import ModelConfig

CFG = ModelConfig(vocab_size=32, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                  num_mtp_heads=2, max_seq_len=128)


@pytest.fixture(scope='module')
def model():
  return tiny_heads.train_tiny(CFG, steps=120, batch_size=8, seq_len=32, lr=3e-3)


@pytest.fixture(scope='module')
def prompts():
  return list(tiny_heads.synthetic_tokens(CFG.vocab_size, 12, range(4), seed=1_000_003))


def test_candidates_cover_plain_chains_trees_adaptive_depth_and_the_context_with_the_options_sampling():
  opts = decode.options(16, draft_depth=2, draft_vocab=np.arange(8), temperature=0.7, top_p=0.9, stop_tokens=(3,),
                        ngram=2)
  got = planner.candidates(opts, num_mtp_heads=2, max_depth=3)
  assert list(got) == ['plain', 'chain1', 'chain2', 'chain3', 'tree2x1', 'tree3x1', 'tree2x2', 'tree3x2',
                       'chain3@0.5', 'context2', 'context4', 'both3']
  assert got['plain'].draft == DraftPlan()
  assert got['tree3x2'].draft == DraftPlan(2, (3, 2), 0.0, tuple(range(8)), ngram=2)
  assert got['chain3@0.5'].draft == DraftPlan(3, (), 0.5, tuple(range(8)), ngram=2)
  assert got['context4'].draft == DraftPlan(4, (), 0.0, tuple(range(8)), 'context', 2)
  assert got['both3'].draft == DraftPlan(3, (), 0.0, tuple(range(8)), 'both', 2)
  for o in got.values():  # only the draft plan varies
    assert dataclasses.replace(o, draft=DraftPlan()) == opts.plain()
  assert list(planner.candidates(decode.options(16), num_mtp_heads=1)) == ['plain', 'chain1', 'context2', 'context4',
                                                                       'both1']


def test_choose_maximises_tokens_per_step_cost_and_keeps_plain_unless_beaten_by_the_margin():
  cost = {'plain': 1.0, 'chain1': 1.3, 'chain2': 1.6, 'tree2x1': 2.5}
  tpf = {'plain': 1.0, 'chain1': 1.7, 'chain2': 2.2, 'tree2x1': 2.6}
  name, rows = planner.choose(cost, tpf, margin=0.03)
  assert name == 'chain2' and rows['chain2']['predicted_speedup'] == pytest.approx(2.2 / 1.6)
  assert rows['tree2x1']['predicted_speedup'] == pytest.approx(2.6 / 2.5)
  slow = {**cost, 'chain1': 1.69, 'chain2': 2.3, 'tree2x1': 3.0}  # chain1 at 1.006x: inside the margin
  assert planner.choose(slow, tpf, margin=0.03)[0] == 'plain'
  assert planner.choose(slow, tpf, margin=0.0)[0] == 'chain1'


@pytest.mark.usefixtures('few_candidates')  # every candidate decodes in the test below
def test_plan_measures_caches_and_picks_what_its_table_says(model, prompts, tmp_path, monkeypatch):
  opts = decode.options(16)
  lines = []
  first = planner.plan(model, prompts, opts, batch_size=2, pad_multiple=16, cache_dir=str(tmp_path), log=lines.append)
  assert set(first.rows) == set(planner.candidates(opts, 2)) and first.name in first.rows
  assert first.rows['plain'] == {'step_cost': 1.0, 'tokens_per_forward': 1.0, 'predicted_speedup': 1.0}
  for name, r in first.rows.items():
    depth = planner.candidates(opts, 2)[name].draft.depth
    assert r['step_cost'] > 0 and 1.0 <= r['tokens_per_forward'] <= depth + 1
  best = max(first.rows, key=lambda n: first.rows[n]['predicted_speedup'])
  assert first.name == (best if first.rows[best]['predicted_speedup'] > 1.03 else 'plain')
  assert any('<- chosen' in line and line.split()[0] == first.name for line in lines)
  # The costs come back from the cache and the acceptance from the first plan: nothing is measured again.
  monkeypatch.setattr(evaluate, 'step_seconds', lambda *a, **k: pytest.fail('a cached cost was measured again'))
  monkeypatch.setattr(planner, 'acceptance', lambda *a, **k: pytest.fail('a given acceptance was measured again'))
  tpf = {n: r['tokens_per_forward'] for n, r in first.rows.items()}
  again = planner.plan(model, prompts, opts, batch_size=2, pad_multiple=16, cache_dir=str(tmp_path),
                       tokens_per_forward=tpf, log=lines.append)
  assert again.name == first.name and set(again.rows) == set(first.rows)
  for name, row in first.rows.items():
    assert again.rows[name] == pytest.approx(row)


def test_plain_when_nothing_pays_and_the_pick_decodes_losslessly(model, prompts, monkeypatch):
  def step_seconds(model, prompts, settings, **kwargs):  # speculation 10x dearer per step than it can repay
    return {name: 0.01 if name == 'plain' else 0.1 for name in settings}
  monkeypatch.setattr(evaluate, 'step_seconds', step_seconds)
  choice = planner.plan(model, prompts, decode.options(16), batch_size=2, pad_multiple=16, log=lambda _: None)
  assert choice.name == 'plain' and choice.opts.draft.depth == 0
  got = planner.measure(model, prompts, choice, batch_size=2, pad_multiple=16, repeats=1, log=lambda _: None)
  assert got['setting'] == 'plain' and got['lossless'] is True and got['speedup_measured'] > 0
  monkeypatch.undo()
  cheap = lambda model, prompts, settings, **kwargs: {name: 0.01 for name in settings}  # drafting free
  monkeypatch.setattr(evaluate, 'step_seconds', cheap)
  choice = planner.plan(model, prompts, decode.options(16), batch_size=2, pad_multiple=16, log=lambda _: None)
  assert choice.name != 'plain' and choice.rows[choice.name]['tokens_per_forward'] > 1.03
  got = planner.measure(model, prompts, choice, batch_size=2, pad_multiple=16, repeats=1, log=lambda _: None)
  assert got['lossless'] is True and got['tokens_per_forward'] >= 1.0
  with pytest.raises(ValueError, match='needs at least one calibration prompt'):
    planner.plan(model, [], decode.options(16), batch_size=2)


@pytest.mark.usefixtures('few_candidates')
def test_eval_speculation_auto_times_the_planners_pick_on_every_set_after_the_configured_one(tmp_path):
  """`eval.speculation='auto'`: the configured decoding's tables as before, plus per set the pick of a
  planner calibrated on prompts past eval.max_prompts, timed against plain decoding."""
  from conftest import small_config
  from mtpd_jax.harness import experiment, recipe
  c = small_config(num_mtp_heads=2, steps=4)
  c.eval.update(dict(max_prompts=2, max_new_tokens=8, repeats=1, timing_steps=4, timing_repeats=1,
                     speculation='auto', calibration_prompts=3))
  c.data.cache_dir = str(tmp_path / 'cache')
  measured = recipe.prompt_sets(c)['synthetic']
  calibration = recipe.calibration_prompts(c)
  assert len(calibration) == 3 and not any(np.array_equal(a, b) for a in calibration for b in measured)
  result = experiment.run_point(c, str(tmp_path / 'run'), root=str(tmp_path), progress=False)
  (r,) = result['eval']['prompt_sets'].values()
  assert r['draft_depth'] == 2 and r['lossless'] is True  # the configured chain, as without the planner
  auto = r['auto']
  assert auto['setting'] in planner.candidates(decode.options(8), 2) and auto['lossless'] is True
  assert auto['speedup_measured'] > 0 and auto['predicted_speedup'] >= 1.0
  assert list((tmp_path / 'cache' / 'planner').glob('*.json'))  # the step costs, kept for the next run
  c.eval.max_prompts = 10_000
  with pytest.raises(ValueError, match='calibrates on prompts past eval.max_prompts'):
    recipe.calibration_prompts(c)
