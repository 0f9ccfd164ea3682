"""Sweep reports: the paired bootstrap of two rows' acceptance on the same prompts, and its table."""

import json

import numpy as np
import pytest

from mtpd_jax.harness import experiment, report


def _counts(steps, acc1, acc):
  return np.array([steps, acc1, acc], float).T


def test_identical_rows_differ_by_exactly_zero():
  a = _counts([10, 20, 30], [3, 9, 12], [4, 12, 20])
  d = report.paired_bootstrap(a, a.copy())
  for key in ('ar1', 'tokens_per_forward'):
    assert d[key] == {'diff': 0.0, 'lo': 0.0, 'hi': 0.0, 'verdict': 'inconclusive'}


def test_the_difference_is_of_pooled_rates_and_a_uniform_gain_is_higher():
  b = _counts([10, 20, 30, 40], [2, 4, 6, 8], [2, 5, 6, 9])
  a = _counts([10, 20, 30, 40], [5, 10, 15, 20], [6, 12, 18, 25])
  d = report.paired_bootstrap(a, b)
  assert d['prompts'] == 4
  assert d['ar1']['diff'] == pytest.approx(50 / 100 - 20 / 100)
  assert d['tokens_per_forward']['diff'] == pytest.approx(61 / 100 - 22 / 100)
  assert 0 < d['ar1']['lo'] <= d['ar1']['diff'] <= d['ar1']['hi'] and d['ar1']['verdict'] == 'higher'
  assert report.paired_bootstrap(b, a)['ar1']['verdict'] == 'lower'


def _simulate(rng, p, rate_a, rate_b, noise):
  """Prompts whose own difficulty (shared by both rows: the pairing) moves both rates."""
  steps = rng.integers(20, 60, p)
  level = rng.normal(0, noise, p)
  acc = lambda r: rng.binomial(steps, np.clip(r + level, 0.01, 0.99))
  a1, b1 = acc(rate_a), acc(rate_b)
  return _counts(steps, a1, a1), _counts(steps, b1, b1)


def test_the_interval_covers_the_true_difference_and_holds_zero_without_one():
  rng = np.random.default_rng(0)
  covered, zero_held = 0, 0
  for _ in range(20):
    a, b = _simulate(rng, 64, 0.40, 0.30, 0.15)
    d = report.paired_bootstrap(a, b, samples=1000)['ar1']
    covered += d['lo'] <= 0.10 <= d['hi']
    a, b = _simulate(rng, 64, 0.35, 0.35, 0.15)
    zero_held += report.paired_bootstrap(a, b, samples=1000)['ar1']['verdict'] == 'inconclusive'
  assert covered >= 17 and zero_held >= 17  # a 95% interval: about 19 of 20


def _run(per_prompt=True, acc1=(1, 2)):
  pp = {'steps': [10, 10], 'accepted_1': list(acc1), 'accepted': list(acc1)}
  s = {'ar': [0.1], 'car': [0.1], 'tokens_per_forward': 1.1, 'speedup_measured': 1.0, 'spec_tokens_per_s': 9.0,
       'main_accuracy': 0.5, **({'per_prompt': pp} if per_prompt else {})}
  return {'eval': {'prompt_sets': {'chat': s}, 'heldout': {'accuracy': 0.5}}}


def test_rows_pair_with_their_reference_and_old_results_without_counts_are_skipped(tmp_path):
  rows = [('MTP', [_run(acc1=(1, 2))]), ('MTP-D', [_run(acc1=(5, 6))]), ('old', [_run(per_prompt=False)])]
  refs = experiment.references([{'label': 'MTP'}, {'label': 'MTP-D'}, {'label': 'old'}])
  assert refs == {'MTP-D': 'MTP', 'old': 'MTP'}
  paired = report.paired_differences(rows, refs)
  assert list(paired) == ['MTP-D'] and paired['MTP-D']['reference'] == 'MTP'
  assert paired['MTP-D']['sets']['chat']['ar1']['diff'] == pytest.approx(0.4)
  table = report.paired_table(paired)
  assert '| MTP-D | MTP | chat | 2 | +40.00 [' in table
  md = report.write(rows, [[], [], []], str(tmp_path), title='t', num_seeds=1, references=refs)
  assert '## Paired differences from a reference row' in md
  saved = json.loads((tmp_path / 'results.json').read_text())
  assert list(saved['rows']) == ['MTP', 'MTP-D', 'old'] and list(saved['paired']) == ['MTP-D']


def test_a_point_names_its_reference_and_an_unknown_one_is_refused():
  sweep = [{'label': 'a'}, {'label': 'b', 'x.y': 1}, {'label': 'c', 'reference': 'b'}]
  assert experiment.references(sweep) == {'b': 'a', 'c': 'b'}
  assert experiment.sweep_points(sweep)[2] == ('c', {})  # 'reference' is not a config override
  with pytest.raises(ValueError, match="names reference 'z'"):
    experiment.references([{'label': 'a'}, {'label': 'b', 'reference': 'z'}])
