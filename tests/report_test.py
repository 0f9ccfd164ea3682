"""Sweep reports: the paired bootstrap of two rows' acceptance on the same prompts, and its table."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from mtpd_jax.harness import experiment, paired, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _counts(steps, acc1, acc):
  return np.array([steps, acc1, acc], float).T


def test_identical_rows_differ_by_exactly_zero():
  a = _counts([10, 20, 30], [3, 9, 12], [4, 12, 20])
  d = paired.paired_bootstrap(a, a.copy())
  for key in ('ar1', 'tokens_per_forward'):
    assert d[key] == {'diff': 0.0, 'lo': 0.0, 'hi': 0.0, 'verdict': 'inconclusive'}


def test_the_difference_is_of_pooled_rates_and_a_uniform_gain_is_higher():
  b = _counts([10, 20, 30, 40], [2, 4, 6, 8], [2, 5, 6, 9])
  a = _counts([10, 20, 30, 40], [5, 10, 15, 20], [6, 12, 18, 25])
  d = paired.paired_bootstrap(a, b)
  assert d['prompts'] == 4
  assert d['ar1']['diff'] == pytest.approx(50 / 100 - 20 / 100)
  assert d['tokens_per_forward']['diff'] == pytest.approx(61 / 100 - 22 / 100)
  assert 0 < d['ar1']['lo'] <= d['ar1']['diff'] <= d['ar1']['hi'] and d['ar1']['verdict'] == 'higher'
  assert paired.paired_bootstrap(b, a)['ar1']['verdict'] == 'lower'


def test_prompts_without_a_step_leave_no_nan_in_the_interval():
  # Two of four prompts end before any step: a resample that draws only them has no rate (6% of
  # resamples), and is left out instead of turning both percentiles into nan.
  b = _counts([0, 12, 0, 20], [0, 3, 0, 5], [0, 3, 0, 6])
  a = _counts([0, 12, 0, 20], [0, 6, 0, 10], [0, 7, 0, 12])
  with warnings.catch_warnings():
    warnings.simplefilter('error')  # no 0 / 0 either
    d = paired.paired_bootstrap(a, b)['ar1']
  assert d['diff'] == pytest.approx(16 / 32 - 8 / 32)
  assert 0 < d['lo'] <= d['diff'] <= d['hi'] and d['verdict'] == 'higher'
  none = paired.paired_bootstrap(_counts([0, 0], [0, 0], [0, 0]), _counts([0, 0], [0, 0], [0, 0]))['ar1']
  assert np.isnan([none['diff'], none['lo'], none['hi']]).all() and none['verdict'] == 'inconclusive'


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
    d = paired.paired_bootstrap(a, b, samples=1000)['ar1']
    covered += d['lo'] <= 0.10 <= d['hi']
    a, b = _simulate(rng, 64, 0.35, 0.35, 0.15)
    zero_held += paired.paired_bootstrap(a, b, samples=1000)['ar1']['verdict'] == 'inconclusive'
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
  diffs = paired.paired_differences(rows, refs)
  assert list(diffs) == ['MTP-D'] and diffs['MTP-D']['reference'] == 'MTP'
  assert diffs['MTP-D']['sets']['chat']['ar1']['diff'] == pytest.approx(0.4)
  table = report.paired_table(diffs)
  assert '| MTP-D | MTP | chat | 2 × 1 | +40.00 [+40.00, +40.00] | +40.0 |' in table
  md = report.write(rows, [[], [], []], str(tmp_path), title='t', num_seeds=1, references=refs)
  assert '## Paired differences from a reference row' in md
  saved = json.loads((tmp_path / 'results.json').read_text())
  assert list(saved['rows']) == ['MTP', 'MTP-D', 'old'] and list(saved['paired']) == ['MTP-D']


def _timed(speedup, spec_tokens_per_s):
  run = _run()
  run['eval']['prompt_sets']['chat'].update(speedup_measured=speedup, spec_tokens_per_s=spec_tokens_per_s)
  return run


def test_speed_across_rows_is_the_ratio_of_side_by_side_speedups_and_says_when_all_lose():
  # Two identical models timed minutes apart: the machine ran the second 1.222x faster, plain and
  # speculative alike, so raw tokens/s differ while each speedup over its own plain decoding does not.
  rows = [('MTP', [_timed(0.6, 9.0)]), ('Top N = 1', [_timed(0.6, 11.0)]), ('MTP-D', [_timed(0.75, 9.0)])]
  table = report.results_table(rows)
  cells = {line.split(' | ')[0][2:]: line.split(' | ')[-1] for line in table.splitlines()[2:]}
  assert cells == {'MTP': '1.000× |', 'Top N = 1': '1.000× |', 'MTP-D': '1.250× |'}
  assert 'slower than plain decoding in every row' in report.speed_caption(rows)
  moe = _timed(0.6, 18.0)
  moe['eval']['trunk'] = 'moe'  # another trunk decodes plainly at another cost: raw tokens/s compare
  assert report.results_table(rows + [('MoE', [moe])]).splitlines()[-1].endswith(' | 2.000× (tokens/s) |')
  assert 'in every row' not in report.speed_caption(rows + [('fast', [_timed(1.1, 9.0)])])
  rows[2][1][0]['eval']['prompt_sets']['chat']['speedup_batch1'] = 1.05  # faster one prompt at a time
  assert 'in every row' not in report.speed_caption(rows)
  assert report.NOISE not in table and report.NOISE.strip() not in report.speed_caption(rows)  # no rounds kept


def test_a_speed_whose_timing_rounds_reach_plain_or_the_first_rows_is_marked_inside_noise():
  def timed(speedup, rounds):
    run = _timed(speedup, 9.0)
    run['eval']['prompt_sets']['chat']['speedup_rounds'] = rounds
    return run
  rows = [('MTP', [timed(0.85, [0.85, 0.80, 0.83])]), ('Top N = 1', [timed(0.76, [0.76, 0.82, 0.79])]),
          ('fast', [timed(1.3, [1.3, 1.25, 1.28])]), ('plain-like', [timed(1.02, [1.02, 0.97, 1.0])])]
  assert report.round_range([rows[1][1][0]['eval']], 'speedup') == (0.76, 0.82)
  cells = {line.split(' | ')[0][2:]: line.split(' | ')[-2:] for line in report.results_table(rows).splitlines()[2:]}
  assert cells['MTP'] == ['0.850×', '1.000× |']
  assert cells['Top N = 1'] == ['0.760×', '0.894× (inside noise) |']   # 0.76-0.82 meets 0.80-0.85
  assert cells['fast'] == ['1.300×', '1.529× |']
  assert cells['plain-like'] == ['1.020× (inside noise)', '1.200× |']  # 0.97-1.02 holds 1x
  assert 'marked (inside noise)' in report.speed_caption(rows)
  one = [(label, [timed(r, [r])]) for label, r in (('MTP', 0.85), ('Top N = 1', 0.7))]  # eval.repeats = 1
  assert report.NOISE not in report.results_table(one) and 'one timing round' in report.speed_caption(one)


def test_seeds_are_resampled_so_their_spread_widens_the_interval():
  rng = np.random.default_rng(1)
  steps = rng.integers(40, 60, 64)
  b = _counts(steps, steps // 4, steps // 4)
  # Three seeds of 64 prompts: seeds 0 and 2 gain 20 points, seed 1 loses 10, each on every prompt.
  a_seeds = [_counts(steps, np.round(steps * r), np.round(steps * r)) for r in (0.45, 0.15, 0.45)]
  pooled = paired.paired_bootstrap(np.concatenate(a_seeds), np.concatenate([b] * 3))['ar1']
  two_level = paired.paired_bootstrap(np.stack(a_seeds), np.stack([b] * 3))
  assert two_level['seeds'] == 3 and two_level['prompts'] == 64
  assert two_level['ar1']['diff'] == pytest.approx(pooled['diff'])
  np.testing.assert_allclose(two_level['ar1_per_seed'], [0.2, -0.1, 0.2], atol=0.01)
  assert pooled['verdict'] == 'higher'  # prompts alone: every prompt gains on average
  assert two_level['ar1']['lo'] < 0 < two_level['ar1']['hi'] and two_level['ar1']['verdict'] == 'inconclusive'
  # One seed: the two-level resample is the prompt bootstrap, to the last bit.
  assert paired.paired_bootstrap(a_seeds[0][None], b[None])['ar1'] == paired.paired_bootstrap(a_seeds[0], b)['ar1']


def test_seed_interval_is_the_t_interval_of_the_mean_paired_difference():
  d = paired.seed_interval([0.01, 0.02, 0.03])
  half = 4.302653 * 0.01 / np.sqrt(3)  # t(0.975, 2 degrees of freedom) · sd / sqrt(n)
  assert d['diff'] == pytest.approx(0.02) and d['seeds'] == 3
  assert (d['lo'], d['hi']) == pytest.approx((0.02 - half, 0.02 + half)) and d['verdict'] == 'inconclusive'
  assert paired.seed_interval([0.05, 0.06, 0.07])['verdict'] == 'higher'
  assert paired.seed_interval([0.05]) is None and paired.seed_interval([0.05, None]) is None


def _seeded_run(ar, car, acc1):
  run = _run(acc1=acc1)
  run['eval']['prompt_sets']['chat'].update(ar=ar, car=car)
  run['eval']['prompt_sets']['code'] = {**run['eval']['prompt_sets']['chat'], 'ar': [a / 2 for a in ar]}
  return run


def test_all_pools_the_prompt_sets_and_bars_carry_the_seed_spread(tmp_path):
  rows = [('MTP', [_seeded_run([0.2, 0.1], [0.2, 0.02], (1, 2)) for _ in range(3)]),
          ('MTP-D', [_seeded_run([0.4 + 0.1 * s, 0.2], [0.4, 0.08], (5, 6)) for s in range(3)])]
  sets = paired.paired_differences(rows, {'MTP-D': 'MTP'})['MTP-D']['sets']
  assert set(sets) == {'chat', 'code', 'all'}
  assert sets['all']['prompts'] == 4 and sets['all']['seeds'] == 3
  assert sets['all']['ar1']['diff'] == pytest.approx(0.4)
  mean, spread = report.head_bars(rows, 'ar')
  # AR of head 1 averaged over chat (x) and code (x / 2): 0.75·x, in %.
  np.testing.assert_allclose(mean, [[15.0, 7.5], [37.5, 15.0]])
  np.testing.assert_allclose(spread, [[0.0, 0.0], [7.5, 0.0]])
  md = report.write(rows, [[], []], str(tmp_path), title='t', num_seeds=3, references={'MTP-D': 'MTP'})
  assert '3 seeds per row' in md and '37.50 ± 7.50' in md and '| MTP-D | MTP | all | 4 × 3 |' in md
  assert (tmp_path / 'acceptance.png').stat().st_size > 0
  main = paired.paired_differences(rows, {'MTP-D': 'MTP'})['MTP-D']['main']
  assert main['heldout_acc']['diff'] == 0.0 and main['heldout_acc']['seeds'] == 3
  assert '## The main head: paired differences over seeds' in md and '| MTP-D | MTP | 3 | +0.00 [+0.00, +0.00] inconclusive |' in md
  one = report.write([(label, runs[:1]) for label, runs in rows], [[], []], str(tmp_path), title='t', num_seeds=1)
  assert '±' not in one.replace('mean ± std', '') and 'no spread is shown' in one
  assert 'The main head: paired differences' not in one  # one seed: no interval over seeds


def test_a_point_names_its_reference_and_an_unknown_one_is_refused():
  sweep = [{'label': 'a'}, {'label': 'b', 'x.y': 1}, {'label': 'c', 'reference': 'b'}]
  assert experiment.references(sweep) == {'b': 'a', 'c': 'b'}
  assert experiment.sweep_points(sweep)[2] == ('c', {})  # 'reference' is not a config override
  with pytest.raises(ValueError, match="names reference 'z'"):
    experiment.references([{'label': 'a'}, {'label': 'b', 'reference': 'z'}])


def _seed_run(seed, acc1, heldout):
  run = _run(acc1=acc1)
  run['eval']['heldout']['accuracy'] = heldout
  return {**run, 'seed': seed}


def test_seeds_pair_by_id_and_a_seed_missing_on_one_side_is_left_out_with_a_warning(tmp_path):
  # The reference's own counts vary by seed (seed s accepts s+1 of 10 steps per prompt); the row
  # gains 1, 3 and 1 of 10 on seeds 0, 1, 2, and its held-out accuracy is 0.002 above each seed's.
  ref = [_seed_run(s, (s + 1, s + 1), 0.5 + 0.01 * s) for s in range(3)]
  row = [_seed_run(s, (s + 1 + g, s + 1 + g), 0.502 + 0.01 * s) for s, g in zip(range(3), (1, 3, 1))]
  rows = [('ref', ref), ('row', row)]
  full = paired.paired_differences(rows, {'row': 'ref'})['row']
  np.testing.assert_allclose(full['sets']['chat']['ar1_per_seed'], [0.1, 0.3, 0.1])
  assert full['unpaired'] == {} and full['main']['heldout_acc']['diff'] == pytest.approx(0.002)
  # Seed 0 of the row is lost (a run skipped): seeds 1 and 2 still meet their own reference seeds,
  # where pairing by position would read +0.4 and +0.2 against seeds 0 and 1.
  lost = paired.paired_differences([('ref', ref), ('row', row[1:])], {'row': 'ref'})['row']
  np.testing.assert_allclose(lost['sets']['chat']['ar1_per_seed'], [0.3, 0.1])
  assert lost['sets']['chat']['seeds'] == 2 and lost['unpaired'] == {'reference': [0]}
  assert lost['main']['heldout_acc']['diff'] == pytest.approx(0.002) and lost['main']['heldout_acc']['seeds'] == 2
  md = report.write([('ref', ref), ('row', row[1:])], [[], []], str(tmp_path), title='t', num_seeds=3,
                    references={'row': 'ref'})
  assert 'Warning: seed 0 of "ref" has no counterpart in "row" and is left out of their paired differences.' in md
  assert 'Warning' not in report.write(rows, [[], []], str(tmp_path), title='t', num_seeds=3,
                                       references={'row': 'ref'})


def test_the_report_is_its_data_file_regenerated_and_the_command_prints_it(tmp_path):
  rows = [('MTP', [_seeded_run([0.2, 0.1], [0.2, 0.02], (1, 2)) for _ in range(2)]),
          ('MTP-D', [_seeded_run([0.4, 0.2], [0.4, 0.08], (5, 6)) for _ in range(2)])]
  rows = [(label, [{**r, 'seed': s} for s, r in enumerate(runs)]) for label, runs in rows]
  run_dir = tmp_path / 'run'
  run_dir.mkdir()
  (run_dir / 'metrics.jsonl').write_text('\n'.join(json.dumps(r) for r in [
      {'step': 5, 'train/xent': 3.0, 'train/mtp/k1/xent': 3.5},
      {'step': 10, 'eval/mtp/k1/xent': 3.25, 'eval/mtp/k1/agree': 0.125, 'eval/xent': 2.0},
      {'step': 20, 'eval/mtp/k1/xent': 3.0, 'eval/mtp/k1/agree': 0.25, 'eval/xent': 1.9},
      {'step': 20, 'eval/mtp/k1/xent': 3.0, 'eval/mtp/k1/agree': 0.25, 'eval/xent': 1.9}]))  # a resumed run's repeat
  out = tmp_path / 'report'
  md = report.write(rows, [[str(run_dir)], []], str(out), title='t', num_seeds=2, references={'MTP-D': 'MTP'},
                    tokens_per_step=1024)
  data = json.loads((out / 'data.json').read_text())
  assert report.markdown(data) == md
  assert [r['seed'] for r in data['rows'][1]['runs']] == [0, 1] and 'final' not in data['rows'][1]['runs'][0]
  assert '| 10 | 10,240 | 3.250 | 12.5 |' in md and '| 20 | 20,480 | 3.000 | 25.0 |' in md
  assert md.count('| 20 | 20,480 |') == 1  # the repeated evaluation is one line
  assert '| MTP-D | chat |' in md.split('## Decoding cost')[1]
  result = subprocess.run([sys.executable, '-m', 'experiments.report', str(out / 'data.json'),
                           f'--out_dir={tmp_path / "again"}'], capture_output=True, text=True, cwd=ROOT)
  assert result.returncode == 0, result.stderr
  assert result.stdout == md + '\n' and (tmp_path / 'again' / 'results.md').read_text() == md


@pytest.mark.parametrize('content, message', [
    (None, 'does not exist'), ('{"rows": ', 'is not JSON'), ('{"rows": []}', 'is not a report data file')])
def test_a_bad_data_file_is_one_line_and_exit_2(tmp_path, content, message):
  path = tmp_path / 'data.json'
  if content is not None:
    path.write_text(content)
  result = subprocess.run([sys.executable, '-m', 'experiments.report', str(path)], capture_output=True, text=True,
                          cwd=ROOT)
  assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_learning_curves_keep_each_held_out_evaluation_once_and_tabulate_every_head(tmp_path):
  """A row's curve is the `eval/` lines of its first seed's metrics.jsonl that carry head metrics,
  one per step (a resumed run may log a step twice), and the table gives each head's xent and
  agreement, with the tokens seen."""
  lines = [{'step': 2, 'train/loss': 5.0},
           {'step': 4, 'eval/loss': 4.5, 'eval/mtp/k1/xent': 4.0, 'eval/mtp/k1/agree': 0.25},
           {'step': 4, 'eval/loss': 4.5, 'eval/mtp/k1/xent': 4.0, 'eval/mtp/k1/agree': 0.25},
           {'step': 8, 'eval/loss': 4.0, 'eval/mtp/k1/xent': 3.5, 'eval/mtp/k1/agree': 0.5,
            'eval/mtp/k2/xent': 3.75}]
  run = tmp_path / 'seed0'
  run.mkdir()
  (run / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in lines))
  got = report.curves([[str(run)], []])
  assert got[1] == []  # a row without runs
  assert [r['step'] for r in got[0]] == [4, 8] and 'train/loss' not in got[0][0]
  table = report.curve_table(got[0], tokens_per_step=1000).splitlines()
  assert table[0] == '| step | tokens seen | head 1 xent | head 1 agree % | head 2 xent | head 2 agree % |'
  assert table[2:] == ['| 4 | 4,000 | 4.000 | 25.0 | – | – |', '| 8 | 8,000 | 3.500 | 50.0 | 3.750 | – |']
