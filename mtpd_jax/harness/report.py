"""Sweep reports in the paper's layout: results.md, results.json and plots, from the runs'
summaries.

A row is one sweep point; with several seeds each cell is mean ± std over them. Columns follow
the paper's Table 2: per prompt set the main-head metric (teacher-forced next-token accuracy on
the set's prompts) and head 1's acceptance rate under greedy speculative decoding, then means.
"""

import json
import os

import numpy as np

from mtpd_jax import runtime, train
from mtpd_jax.harness.paired import (BOOTSTRAP_SAMPLES, paired_differences, set_mean,
                                     unpaired_warnings)


def _mean_pm(values, scale: float = 1.0, digits: int = 2) -> str:
  values = [scale * v for v in values if v is not None and np.isfinite(v)]
  if not values:
    return '–'
  if len(values) == 1:
    return f'{values[0]:.{digits}f}'
  return f'{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}'


def _evals(runs):
  return [r['eval'] for r in runs if r.get('eval')]


def _at(seq, k):
  return seq[k] if k < len(seq) else None


def _prompt_sets(rows):
  """Every evaluated prompt set's metrics, over all rows and seeds."""
  return [p for _, runs in rows for ev in _evals(runs) for p in ev['prompt_sets'].values()]


def _interval(d: dict, scale: float = 100.0, digits: int = 2) -> str:
  """'+diff [lo, hi]' of a paired difference."""
  f = lambda x: f'{scale * x:+.{digits}f}'
  return f"{f(d['diff'])} [{f(d['lo'])}, {f(d['hi'])}]"


NOISE = ' (inside noise)'
PLAIN = (1.0, 1.0)  # plain decoding's speedup, as a range


def round_range(evs, key: str) -> tuple[float, float] | None:
  """The lowest and highest speedup (`key`: 'speedup' or 'speedup_batch1') measured in one of the
  evaluations' timing rounds (eval.repeats), each round's mean over the prompt sets; None for runs
  that did not keep their rounds."""
  values = []
  for ev in evs:
    sets = [p[f'{key}_rounds'] for p in ev['prompt_sets'].values() if p.get(f'{key}_rounds')]
    if sets and len({len(r) for r in sets}) == 1:
      values += np.mean(sets, axis=0).tolist()
  return (min(values), max(values)) if values else None


def _overlap(a, b) -> bool:
  return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


def _speed_cells(evs, base_evs, *, is_base: bool, batch1: bool) -> list[str]:
  """One row's speed columns: its speedup vs plain (and at batch 1), and its speed vs the first row.

  Rows are timed minutes apart, each beside its own plain decoding. Where the two trunks match, the
  ratio of the rows' speedups cancels the machine's load between them (raw tokens/s read 1.22x
  between two identical models); another trunk decodes plainly at another cost, so raw tokens/s
  compare (docs/design.md, "Metrics").
  """
  fmt = lambda values, noise=False: _mean_pm(values, digits=3) + '×' + NOISE * noise
  speedup = lambda ev, key='speedup_measured': set_mean(ev, lambda p: p.get(key))
  mean = lambda values: np.mean(values) if values else np.nan
  spread = round_range(evs, 'speedup')
  cells = [fmt([speedup(ev) for ev in evs], _overlap(spread, PLAIN))]
  if batch1:
    cells.append(fmt([speedup(ev, 'speedup_batch1') for ev in evs],
                     _overlap(round_range(evs, 'speedup_batch1'), PLAIN)))
  if {ev.get('trunk') for ev in evs} == {ev.get('trunk') for ev in base_evs}:
    ref = mean([speedup(ev) for ev in base_evs])
    cells.append(fmt([speedup(ev) / ref for ev in evs],
                     not is_base and _overlap(spread, round_range(base_evs, 'speedup'))))
  else:
    tps = lambda ev: set_mean(ev, lambda p: p['spec_tokens_per_s'])
    ref = mean([tps(ev) for ev in base_evs])
    cells.append(fmt([tps(ev) / ref for ev in evs]) + ' (tokens/s)')
  return cells


def results_table(rows) -> str:
  """Rows = variants; per prompt set 'main acc | AR1' (%), then the means, tokens/forward and
  speed."""
  sets = sorted({n for _, runs in rows for ev in _evals(runs) for n in ev['prompt_sets']})
  base_label, base_runs = rows[0]
  batch1 = any('speedup_batch1' in p for p in _prompt_sets(rows))
  head = (['variant'] + [f'{n}: main acc \\| AR1' for n in sets]
          + ['mean: main acc \\| AR1', 'held-out acc', 'tokens/fwd', 'speedup vs plain']
          + (['speedup vs plain, batch 1'] if batch1 else []) + [f'speed vs "{base_label}"'])
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, runs in rows:
    evs = _evals(runs)
    cells = [label]
    for n in sets:
      acc = [ev['prompt_sets'][n].get('main_accuracy') for ev in evs if n in ev['prompt_sets']]
      ar1 = [_at(ev['prompt_sets'][n]['ar'], 0) for ev in evs if n in ev['prompt_sets']]
      cells.append(f'{_mean_pm(acc, 100)} \\| {_mean_pm(ar1, 100)}')
    acc = [set_mean(ev, lambda p: p.get('main_accuracy')) for ev in evs]
    ar1 = [set_mean(ev, lambda p: _at(p['ar'], 0)) for ev in evs]
    cells.append(f'{_mean_pm(acc, 100)} \\| {_mean_pm(ar1, 100)}')
    cells.append(_mean_pm([ev['heldout']['accuracy'] for ev in evs], 100))
    cells.append(_mean_pm([set_mean(ev, lambda p: p['tokens_per_forward']) for ev in evs]))
    cells += _speed_cells(evs, _evals(base_runs), is_base=label == base_label, batch1=batch1)
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def speed_caption(rows) -> str:
  """What the speed columns say: how they are timed, what their marks mean, and that speculation
  loses everywhere when it does."""
  text = ('speedup vs plain: wall-clock tokens/s of speculative over plain greedy decoding of the '
          'same model, timed side by side; speed vs the first row: that speedup over the first '
          'row\'s (rows are timed at different times, and dividing by the plain decoding timed '
          'beside each cancels the load of the machine between them; a row whose trunk differs '
          'from the first row\'s, as an MoE row\'s, decodes plainly at another cost, and its '
          'cell, marked (tokens/s), divides raw speculative tokens/s timed apart).')
  rounds = {len(p['speedup_rounds']) for p in _prompt_sets(rows) if p.get('speedup_rounds')}
  if rounds == {1}:
    text += (' Each speed is one timing round (eval.repeats = 1, a smoke timing): none of '
             'their differences can be told from noise.')
  elif rounds:
    text += (f' A speed marked {NOISE.strip()}: the speedups its eval.repeats timing rounds '
             'measured reach 1× (plain decoding), or the first row\'s, so the timing cannot '
             'tell the two apart.')
  speedups = [set_mean(ev, lambda p, key=key: p.get(key)) for _, runs in rows
              for ev in _evals(runs) for key in ('speedup_measured', 'speedup_batch1')]
  speedups = [s for s in speedups if s is not None]
  if speedups and all(s < 1.0 for s in speedups):
    text += (' On this model speculative decoding is slower than plain decoding in every row: '
             'its steps cost more than the tokens per forward repay, so the speed columns say '
             'how much slower, and the acceptance columns are the result.')
  return text


def depth_of(rows) -> int:
  return max((len(p['ar']) for p in _prompt_sets(rows)), default=0)


def per_head_table(rows) -> str:
  """Rows = variants, columns = draft depths, cells 'CAR / AR' (%) averaged over prompt sets."""
  depth = depth_of(rows)
  heads = ' | '.join(f'head {k + 1}' for k in range(depth))
  lines = [f'| variant | {heads} |', '|---|' + '---|' * depth]
  for label, runs in rows:
    evs = _evals(runs)
    at_depth = lambda key, k: _mean_pm([set_mean(ev, lambda p: _at(p[key], k)) for ev in evs], 100)
    cells = [f"{at_depth('car', k)} / {at_depth('ar', k)}" for k in range(depth)]
    lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def paired_table(paired: dict) -> str:
  """One line per (row, prompt set): the differences from the reference row and their intervals."""
  lines = ['| variant | minus | set | prompts × seeds | AR1 (points) [95% interval] | AR1 per seed | '
           'tokens/fwd [95% interval] | AR1 |', '|---|---|---|---|---|---|---|---|']
  for label, entry in paired.items():
    for name, d in entry['sets'].items():
      ar, tpf = d['ar1'], d['tokens_per_forward']
      per_seed = ', '.join(f'{100 * x:+.1f}' for x in d.get('ar1_per_seed', ()))
      cells = [label, entry['reference'], name, f"{d['prompts']} × {d.get('seeds', 1)}", _interval(ar),
               per_seed, _interval(tpf, 1.0, 3), ar['verdict']]
      lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def main_head_table(paired: dict) -> str:
  """One line per row with seed-paired main-head intervals (empty without them)."""
  rows = [(label, e) for label, e in paired.items() if e.get('main')]
  if not rows:
    return ''
  cell = lambda d: '–' if d is None else f"{_interval(d)} {d['verdict']}"
  lines = ['| variant | minus | seeds | held-out acc (points) [95% interval] '
           '| prompt-set acc (points) [95% interval] |', '|---|---|---|---|---|']
  for label, e in rows:
    m = e['main']
    seeds = next(iter(m.values()))['seeds']
    cells = [label, e['reference'], str(seeds), cell(m.get('heldout_acc')), cell(m.get('prompt_acc'))]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def _plt():
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  return plt


def head_bars(rows, key: str):
  """[rows, depth] arrays of `key` ('ar' or 'car', %, averaged over prompt sets) per head: the mean
  over seeds, and their standard deviation (0 with one seed; NaN mean where a row has no head)."""
  depth = depth_of(rows)
  mean, spread = np.full((len(rows), depth), np.nan), np.zeros((len(rows), depth))
  for i, (_, runs) in enumerate(rows):
    for k in range(depth):
      values = [set_mean(ev, lambda p: _at(p[key], k)) for ev in _evals(runs)]
      seeds = [100 * v for v in values if v is not None]
      if seeds:
        mean[i, k] = np.mean(seeds)
        spread[i, k] = np.std(seeds, ddof=1) if len(seeds) > 1 else 0.0
  return mean, spread


def plot_acceptance(rows, path: str) -> None:
  """AR and CAR per head as grouped bars, one bar per variant (Figs. 3 and 5); with several seeds
  the bar is their mean and the error bar their standard deviation."""
  depth = depth_of(rows)
  plt = _plt()
  width = 0.8 / max(len(rows), 1)
  fig_width = max(6.0, 1.1 * depth + 0.25 * len(rows) + 3) + 2.5
  fig, axes = plt.subplots(2, 1, figsize=(fig_width, 7), sharex=True)
  for ax, key, title in zip(axes, ('ar', 'car'), ('AR (conditional) %', 'CAR (cumulative) %')):
    mean_by_row, spread_by_row = head_bars(rows, key)
    for i, (label, _) in enumerate(rows):
      x = np.arange(1, depth + 1) + (i - (len(rows) - 1) / 2) * width
      ax.bar(x, mean_by_row[i], width, yerr=spread_by_row[i] if spread_by_row[i].any() else None,
             capsize=2, label=label)
    ax.set(title=title, ylim=(0, 100), xticks=range(1, depth + 1))
    ax.grid(alpha=0.3, axis='y')
  axes[1].set_xlabel('draft depth (head)')
  # Beside the bars, not on them.
  axes[0].legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_loss_curves(rows, run_dirs, path: str) -> None:
  """Training loss of the main head and of every MTP head against step, one panel per variant
  (Fig. 7)."""
  plt = _plt()
  fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 3.2), squeeze=False, sharey=True)
  for ax, (label, _), dirs in zip(axes[0], rows, run_dirs):
    metrics_path = os.path.join(dirs[0], train.METRICS) if dirs else ''
    if os.path.exists(metrics_path):
      with open(metrics_path) as f:
        logged = [r for r in map(json.loads, f) if 'train/xent' in r]
      first = logged[0] if logged else {}
      keys = ['train/xent'] + sorted(k for k in first if k.endswith('/xent') and '/mtp/' in k)
      for key in keys:
        ax.plot([r['step'] for r in logged], [r[key] for r in logged],
                label='main' if key == 'train/xent' else key.split('/')[2])
    ax.set(title=label, xlabel='step')
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a row without metrics.jsonl has no curves to name
      ax.legend(fontsize=6)
  axes[0][0].set_ylabel('cross-entropy')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def curves(run_dirs) -> list[list[dict]]:
  """Per row, its first seed's held-out evaluations during training (the `eval/` lines of its
  metrics.jsonl, with their step; empty without them)."""
  out = []
  for dirs in run_dirs:
    path = os.path.join(dirs[0], train.METRICS) if dirs else ''
    lines = []
    if os.path.exists(path):
      with open(path) as f:
        logged = [r for r in map(json.loads, f) if any(k.startswith('eval/mtp/') for k in r)]
      lines = [{k: v for k, v in r.items() if k == 'step' or k.startswith('eval/')} for r in logged]
    out.append([r for i, r in enumerate(lines) if i == 0 or r['step'] != lines[i - 1]['step']])
  return out


def curve_table(points: list[dict], tokens_per_step: int | None) -> str:
  """One line per held-out evaluation: each head's cross-entropy and agreement with the main
  head."""
  heads = sorted({int(k.split('/')[2][1:]) for r in points for k in r if k.startswith('eval/mtp/')})
  head = ['step'] + (['tokens seen'] if tokens_per_step else []) + [
      f'head {k} {what}' for k in heads for what in ('xent', 'agree %')]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for r in points:
    cells = [str(r['step'])] + ([f"{r['step'] * tokens_per_step:,}"] if tokens_per_step else [])
    for k in heads:
      xent, agree = r.get(f'eval/mtp/k{k}/xent'), r.get(f'eval/mtp/k{k}/agree')
      cells += ['–' if xent is None else f'{xent:.3f}', '–' if agree is None else f'{100 * agree:.1f}']
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def decoding_cost_table(rows) -> str:
  """Per row and prompt set: the measured step costs and what they make of the tokens per forward."""
  lines = ['| variant | set | plain step ms | speculative step ms | verify cost ratio | '
           'tokens / forward | analytic speedup | measured speedup | measured speedup, batch 1 | '
           'lossless |', '|' + '---|' * 10]
  for label, runs in rows:
    evs = _evals(runs)
    for name in sorted({n for ev in evs for n in ev['prompt_sets']}):
      sets = [ev['prompt_sets'][name] for ev in evs if name in ev['prompt_sets']]
      cell = lambda key, digits: _mean_pm([p.get(key) for p in sets], digits=digits)
      cells = [label, name, cell('plain_step_ms', 2), cell('spec_step_ms', 2),
               cell('verify_cost_ratio', 2), cell('tokens_per_forward', 3),
               cell('speedup_analytic', 3), cell('speedup_measured', 3), cell('speedup_batch1', 3),
               str(all(p.get('lossless', False) for p in sets))]
      lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


DATA_FORMAT = 1


def section_data(rows, run_dirs, *, title: str, num_seeds: int,
                 references: dict[str, str] | None = None, tokens_per_step: int | None = None) -> dict:
  """The small JSON a report is computed from (data.json; docs/data/ keeps the published ones): per
  row and seed the evaluation (per-prompt counts included), each row's learning curve, the
  references."""
  return {'format': DATA_FORMAT, 'title': title, 'num_seeds': num_seeds,
          'references': references or {}, 'tokens_per_step': tokens_per_step,
          'rows': [{'label': label, 'runs': [{'seed': int(r.get('seed', i)), 'eval': r['eval']}
                                             for i, r in enumerate(runs) if r.get('eval')]}
                   for label, runs in rows],
          'curves': dict(zip([label for label, _ in rows], curves(run_dirs)))}


def markdown(data: dict, paired: dict | None = None) -> str:
  """The report of a `section_data`: the paper's table, CAR/AR per depth, the paired differences
  (`paired`: `paired_differences` of its rows, computed when not given), the main head's, the
  learning curves (rows evaluated more than once) and the decoding cost."""
  rows = [(r['label'], r['runs']) for r in data['rows']]
  num_seeds = data['num_seeds']
  if paired is None:
    paired = paired_differences(rows, data['references'])
  spread = (f'{num_seeds} seeds per row: each cell is mean ± std over them. ' if num_seeds > 1 else
            '1 seed per row, so no spread is shown (`--config.seeds=3` adds it). ')
  caption = (spread + 'Main acc: the main head\'s teacher-forced next-token accuracy on each prompt '
             'set; held-out acc: on held-out training text. AR1: acceptance rate of head 1 under '
             'greedy speculative decoding of the set. tokens/fwd: emitted tokens per main forward '
             '(the bonus token counts). ' + speed_caption(rows))
  out = [f"# {data['title']}", '', caption, '', results_table(rows), '',
         '## CAR / AR (%) per draft depth, mean over prompt sets', '', per_head_table(rows), '']
  if paired:
    out += ['## Paired differences from a reference row', '',
            'The same prompts decoded by both rows, seed i against seed i; the interval is the '
            f'2.5-97.5 percentile of the difference over {BOOTSTRAP_SAMPLES} resamples of the seeds '
            'and, within each, of the prompts; `all` pools the prompt sets. AR1 says whether the '
            'interval lies above zero (higher), below (lower) or holds zero (inconclusive).', '',
            paired_table(paired), '']
    out += [w + '\n' for w in unpaired_warnings(paired)]
  main_md = main_head_table(paired)
  if main_md:
    out += ['## The main head: paired differences over seeds', '',
            "Seed i of a row minus seed i of its reference; the interval is the mean's 95% "
            't-interval over the seeds (the held-out and prompt-set accuracies are measured once per '
            'seed).', '', main_md, '']
  curve_rows = [(label, points) for label, points in data.get('curves', {}).items() if len(points) > 1]
  if curve_rows:
    out += ['## Learning curves (held-out; agreement: head k\'s argmax equals the main head\'s)', '']
    out += [f'{label} (first seed):\n\n{curve_table(points, data.get("tokens_per_step"))}\n'
            for label, points in curve_rows]
  if depth_of(rows):
    out += ['## Decoding cost (each row\'s eval.json; speculative over plain greedy, one process)', '',
            decoding_cost_table(rows), '']
  return '\n'.join(out)


def write(rows, run_dirs, out_dir: str, *, title: str, num_seeds: int,
          references: dict[str, str] | None = None, tokens_per_step: int | None = None) -> str:
  """results.md, data.json, results.json, acceptance.png and loss_curves.png in `out_dir`; returns
  the markdown, which is `markdown` of data.json (`python -m experiments.report` regenerates it).

  `references` maps a row's label to the row its paired differences are taken against.
  """
  os.makedirs(out_dir, exist_ok=True)
  data = section_data(rows, run_dirs, title=title, num_seeds=num_seeds, references=references,
                      tokens_per_step=tokens_per_step)
  paired = paired_differences(rows, references or {})
  md = markdown(data, paired)
  runtime.write_atomically(os.path.join(out_dir, 'results.md'), md)
  runtime.write_atomically(os.path.join(out_dir, 'data.json'), json.dumps(data, indent=1))
  results = {'rows': {label: runs for label, runs in rows}, 'paired': paired}
  runtime.write_atomically(os.path.join(out_dir, 'results.json'), json.dumps(results, indent=2))
  if depth_of(rows):
    plot_acceptance(rows, os.path.join(out_dir, 'acceptance.png'))
  plot_loss_curves(rows, run_dirs, os.path.join(out_dir, 'loss_curves.png'))
  return md
