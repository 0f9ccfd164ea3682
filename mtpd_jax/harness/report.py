"""Sweep reports in the paper's layout: results.md, results.json and plots, from the runs' summaries.

A row is one sweep point; with several seeds each cell is mean ± std over them. Columns follow
the paper's Table 2: per prompt set the main-head metric (teacher-forced next-token accuracy on
the set's prompts) and head 1's acceptance rate under greedy speculative decoding, then means.
"""

import json
import os

import numpy as np
import scipy.stats


def _mean_pm(values, scale: float = 1.0, digits: int = 2) -> str:
  values = [scale * v for v in values if v is not None and np.isfinite(v)]
  if not values:
    return '–'
  if len(values) == 1:
    return f'{values[0]:.{digits}f}'
  return f'{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}'


def _evals(runs):
  return [r['eval'] for r in runs if r.get('eval')]


def _set_mean(ev, fn):
  vals = [v for v in map(fn, ev['prompt_sets'].values()) if v is not None]
  return float(np.mean(vals)) if vals else None


def _at(seq, k):
  return seq[k] if k < len(seq) else None


def results_table(rows) -> str:
  """Rows = variants; per prompt set 'main acc | AR1' (%), then the means, tokens/forward and speed."""
  sets = sorted({n for _, runs in rows for ev in _evals(runs) for n in ev['prompt_sets']})
  base_label, base_runs = rows[0]
  base_speed = [_set_mean(ev, lambda p: p['spec_tokens_per_s']) for ev in _evals(base_runs)]
  head = (['variant'] + [f'{n}: main acc \\| AR1' for n in sets]
          + ['mean: main acc \\| AR1', 'held-out acc', 'tokens/fwd', 'speedup vs plain',
             f'speed vs "{base_label}"'])
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, runs in rows:
    evs = _evals(runs)
    cells = [label]
    for n in sets:
      acc = [ev['prompt_sets'][n].get('main_accuracy') for ev in evs if n in ev['prompt_sets']]
      ar1 = [_at(ev['prompt_sets'][n]['ar'], 0) for ev in evs if n in ev['prompt_sets']]
      cells.append(f'{_mean_pm(acc, 100)} \\| {_mean_pm(ar1, 100)}')
    cells.append(f"{_mean_pm([_set_mean(ev, lambda p: p.get('main_accuracy')) for ev in evs], 100)} \\| "
                 f"{_mean_pm([_set_mean(ev, lambda p: _at(p['ar'], 0)) for ev in evs], 100)}")
    cells.append(_mean_pm([ev['heldout']['accuracy'] for ev in evs], 100))
    cells.append(_mean_pm([_set_mean(ev, lambda p: p['tokens_per_forward']) for ev in evs]))
    cells.append(_mean_pm([_set_mean(ev, lambda p: p['speedup_measured']) for ev in evs], digits=3) + '×')
    speed = [_set_mean(ev, lambda p: p['spec_tokens_per_s']) for ev in evs]
    ref = np.mean(base_speed) if base_speed else np.nan
    cells.append(_mean_pm([s / ref for s in speed], digits=3) + '×')
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def depth_of(rows) -> int:
  return max((len(p['ar']) for _, runs in rows for ev in _evals(runs) for p in ev['prompt_sets'].values()),
             default=0)


def per_head_table(rows) -> str:
  """Rows = variants, columns = draft depths, cells 'CAR / AR' (%) averaged over prompt sets."""
  depth = depth_of(rows)
  lines = ['| variant | ' + ' | '.join(f'head {k + 1}' for k in range(depth)) + ' |', '|---|' + '---|' * depth]
  for label, runs in rows:
    evs = _evals(runs)
    cells = [f"{_mean_pm([_set_mean(ev, lambda p: _at(p['car'], k)) for ev in evs], 100)} / "
             f"{_mean_pm([_set_mean(ev, lambda p: _at(p['ar'], k)) for ev in evs], 100)}" for k in range(depth)]
    lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


BOOTSTRAP_SAMPLES = 4000


def _prompt_counts(runs, name: str):
  """Per-prompt (steps, accepted_1, accepted) of prompt set `name`, one [P, 3] array per seed (or None)."""
  out = []
  for ev in _evals(runs):
    pp = ev['prompt_sets'].get(name, {}).get('per_prompt')
    out.append(None if pp is None else np.array([pp['steps'], pp['accepted_1'], pp['accepted']], float).T)
  return out


def paired_bootstrap(a, b, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> dict:
  """AR1 and tokens per forward of `a` minus `b` on the same P prompts, for S paired seeds.

  a, b: [P, 3] (one seed) or [S, P, 3] arrays of per-prompt (steps, accepted_1, accepted); seed
  s of `a` is paired with seed s of `b` (the same data order and initial shift). `diff` is the
  difference of the pooled rates; `lo`/`hi` the 2.5 and 97.5 percentiles of it over a two-level
  resample, the same for both rows: S seeds drawn with replacement, then P prompts with
  replacement within each, so the interval holds the seed-to-seed spread as well as the prompts'.
  `verdict` says whether the interval lies above zero, below it, or holds it ('inconclusive').
  A resample that draws only prompts without a decoding step (a prompt that ends at once) has no
  rate and is left out of the percentiles; with no steps at all, every figure is nan.
  """
  a_SxPx3, b_SxPx3 = (np.asarray(x, float).reshape((-1,) + np.shape(x)[-2:]) for x in (a, b))
  s, p = a_SxPx3.shape[:2]
  rng = np.random.default_rng(seed)
  idx_ZxSxP = rng.integers(0, p, size=(samples, s, p))
  weight_ZxSxP = np.zeros((samples, s, p))
  np.add.at(weight_ZxSxP, (np.arange(samples)[:, None, None], np.arange(s)[None, :, None], idx_ZxSxP), 1.0)
  if s > 1:
    seeds_ZxS = rng.integers(0, s, size=(samples, s))
    times_ZxS = np.zeros((samples, s))
    np.add.at(times_ZxS, (np.arange(samples)[:, None], seeds_ZxS), 1.0)
    weight_ZxSxP *= times_ZxS[..., None]

  def rates(w, x):  # (AR1, tokens per forward) of seed-prompts weighted by w; nan without steps
    sums = np.einsum('...sp,spc->...c', w, x)
    steps = np.where(sums[..., 0] > 0, sums[..., 0], np.nan)
    return sums[..., 1] / steps, 1.0 + sums[..., 2] / steps
  full_a, full_b = rates(np.ones((s, p)), a_SxPx3), rates(np.ones((s, p)), b_SxPx3)
  boot_a, boot_b = rates(weight_ZxSxP, a_SxPx3), rates(weight_ZxSxP, b_SxPx3)
  seed_SxSxP = np.repeat(np.eye(s)[:, :, None], p, axis=2)  # row i weighs seed i's prompts alone
  per_seed = rates(seed_SxSxP, a_SxPx3)[0] - rates(seed_SxSxP, b_SxPx3)[0]
  out = {'prompts': p, 'seeds': s, 'ar1_per_seed': [float(x) for x in per_seed]}
  for i, key in enumerate(('ar1', 'tokens_per_forward')):
    d_Z = boot_a[i] - boot_b[i]
    lo, hi = np.percentile(d_Z[np.isfinite(d_Z)], [2.5, 97.5]) if np.isfinite(d_Z).any() else (np.nan, np.nan)
    out[key] = {'diff': float(full_a[i] - full_b[i]), 'lo': float(lo), 'hi': float(hi), 'verdict': _verdict(lo, hi)}
  return out


def _verdict(lo: float, hi: float) -> str:
  return 'higher' if lo > 0 else 'lower' if hi < 0 else 'inconclusive'


def seed_interval(diffs) -> dict | None:
  """The mean of per-seed paired differences and its 95% t-interval over the seeds (None below two):
  for what is measured once per seed, such as the main head's held-out accuracy."""
  d_S = np.asarray([x for x in diffs if x is not None and np.isfinite(x)], float)
  if len(d_S) < 2:
    return None
  mean, half = float(d_S.mean()), float(scipy.stats.t.ppf(0.975, len(d_S) - 1) * d_S.std(ddof=1) / np.sqrt(len(d_S)))
  return {'diff': mean, 'lo': mean - half, 'hi': mean + half, 'seeds': len(d_S), 'verdict': _verdict(mean - half, mean + half)}


def _main_head(runs, ref_runs) -> dict:
  """Seed-paired intervals of the main head's held-out accuracy and mean prompt-set accuracy."""
  pairs = list(zip(_evals(runs), _evals(ref_runs)))
  out = {'heldout_acc': seed_interval([a['heldout']['accuracy'] - b['heldout']['accuracy'] for a, b in pairs]),
         'prompt_acc': seed_interval([(_set_mean(a, lambda p: p.get('main_accuracy')) or np.nan)
                                      - (_set_mean(b, lambda p: p.get('main_accuracy')) or np.nan) for a, b in pairs])}
  return {k: v for k, v in out.items() if v is not None}


def paired_differences(rows, references: dict[str, str]) -> dict:
  """{label: {'reference': ref, 'sets': {set: paired_bootstrap}, 'main': {...}}} for every row with
  a reference; with several prompt sets, 'all' pools their prompts (one verdict per row). 'main'
  holds `seed_interval`s of the main head's accuracy (with two or more seeds).

  Seeds pair up by index (seed i of the row with seed i of its reference); `paired_bootstrap`
  resamples seeds and prompts.
  """
  by_label = dict(rows)
  out = {}
  for label, runs in rows:
    ref = references.get(label)
    if ref is None or not _evals(runs) or not _evals(by_label.get(ref, [])):
      continue
    sets, stacked = {}, {}
    for name in sorted(set(_evals(runs)[0]['prompt_sets']) & set(_evals(by_label[ref])[0]['prompt_sets'])):
      pairs = [(a, b) for a, b in zip(_prompt_counts(runs, name), _prompt_counts(by_label[ref], name))
               if a is not None and b is not None and a.shape == b.shape]
      pairs = [(a, b) for a, b in pairs if a.shape == pairs[0][0].shape]  # every seed decodes the same prompts
      if pairs:
        stacked[name] = np.stack([a for a, _ in pairs]), np.stack([b for _, b in pairs])
        sets[name] = paired_bootstrap(*stacked[name])
    if len({a.shape[0] for a, _ in stacked.values()}) == 1 and len(stacked) > 1:  # the same seeds in every set
      sets['all'] = paired_bootstrap(*(np.concatenate(x, axis=1) for x in zip(*stacked.values())))
    if sets:
      out[label] = {'reference': ref, 'sets': sets, 'main': _main_head(runs, by_label[ref])}
  return out


def paired_table(paired: dict) -> str:
  """One line per (row, prompt set): the differences from the reference row and their intervals."""
  lines = ['| variant | minus | set | prompts × seeds | AR1 (points) [95% interval] | AR1 per seed | '
           'tokens/fwd [95% interval] | AR1 |', '|---|---|---|---|---|---|---|---|']
  for label, entry in paired.items():
    for name, d in entry['sets'].items():
      ar, tpf = d['ar1'], d['tokens_per_forward']
      per_seed = ', '.join(f'{100 * x:+.1f}' for x in d.get('ar1_per_seed', ()))
      lines.append(f"| {label} | {entry['reference']} | {name} | {d['prompts']} × {d.get('seeds', 1)} | "
                   f"{100 * ar['diff']:+.2f} [{100 * ar['lo']:+.2f}, {100 * ar['hi']:+.2f}] | {per_seed} | "
                   f"{tpf['diff']:+.3f} [{tpf['lo']:+.3f}, {tpf['hi']:+.3f}] | {ar['verdict']} |")
  return '\n'.join(lines)


def main_head_table(paired: dict) -> str:
  """One line per row with seed-paired main-head intervals (empty without them)."""
  rows = [(label, e) for label, e in paired.items() if e.get('main')]
  if not rows:
    return ''
  cell = lambda d: '–' if d is None else f"{100 * d['diff']:+.2f} [{100 * d['lo']:+.2f}, {100 * d['hi']:+.2f}] {d['verdict']}"
  lines = ['| variant | minus | seeds | held-out acc (points) [95% interval] | prompt-set acc (points) [95% interval] |',
           '|---|---|---|---|---|']
  for label, e in rows:
    m = e['main']
    seeds = next(iter(m.values()))['seeds']
    lines.append(f"| {label} | {e['reference']} | {seeds} | {cell(m.get('heldout_acc'))} | {cell(m.get('prompt_acc'))} |")
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
      seeds = [100 * v for ev in _evals(runs) if (v := _set_mean(ev, lambda p: _at(p[key], k))) is not None]
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
  fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 1.1 * depth + 0.25 * len(rows) + 3) + 2.5, 7), sharex=True)
  for ax, key, title in zip(axes, ('ar', 'car'), ('AR (conditional) %', 'CAR (cumulative) %')):
    mean_RxK, spread_RxK = head_bars(rows, key)
    for i, (label, _) in enumerate(rows):
      x = np.arange(1, depth + 1) + (i - (len(rows) - 1) / 2) * width
      ax.bar(x, mean_RxK[i], width, yerr=spread_RxK[i] if spread_RxK[i].any() else None, capsize=2, label=label)
    ax.set(title=title, ylim=(0, 100), xticks=range(1, depth + 1))
    ax.grid(alpha=0.3, axis='y')
  axes[1].set_xlabel('draft depth (head)')
  axes[0].legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0))  # beside the bars, not on them
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_loss_curves(rows, run_dirs, path: str) -> None:
  """Training loss of the main head and of every MTP head against step, one panel per variant (Fig. 7)."""
  plt = _plt()
  fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 3.2), squeeze=False, sharey=True)
  for ax, (label, _), dirs in zip(axes[0], rows, run_dirs):
    metrics_path = os.path.join(dirs[0], 'metrics.jsonl') if dirs else ''
    if os.path.exists(metrics_path):
      with open(metrics_path) as f:
        logged = [r for r in map(json.loads, f) if 'train/xent' in r]
      keys = ['train/xent'] + sorted(k for k in (logged[0] if logged else {}) if k.endswith('/xent') and '/mtp/' in k)
      for key in keys:
        ax.plot([r['step'] for r in logged], [r[key] for r in logged],
                label='main' if key == 'train/xent' else key.split('/')[2])
    ax.set(title=label, xlabel='step')
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  axes[0][0].set_ylabel('cross-entropy')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write(rows, run_dirs, out_dir: str, *, title: str, num_seeds: int, references: dict[str, str] | None = None) -> str:
  """results.md, results.json, acceptance.png and loss_curves.png in `out_dir`; returns the markdown.

  `references` maps a row's label to the row its paired differences are taken against.
  """
  os.makedirs(out_dir, exist_ok=True)
  paired = paired_differences(rows, references or {})
  main_md = main_head_table(paired)
  md = '\n'.join([
      f'# {title}', '',
      (f'{num_seeds} seeds per row: each cell is mean ± std over them. ' if num_seeds > 1 else
       '1 seed per row, so no spread is shown (`--config.seeds=3` adds it). ') + 'Main acc: the main head\'s teacher-forced next-token '
      'accuracy on each prompt set; held-out acc: on held-out training text. AR1: acceptance rate of head '
      '1 under greedy speculative decoding of the set. tokens/fwd: emitted tokens per main forward (the '
      'bonus token counts). speedup vs plain: wall-clock tokens/s of speculative over plain greedy '
      'decoding of the same model; speed vs the first row: speculative tokens/s relative to that row.', '',
      results_table(rows), '', '## CAR / AR (%) per draft depth, mean over prompt sets', '',
      per_head_table(rows), ''] + ([
          '## Paired differences from a reference row', '',
          f'The same prompts decoded by both rows, seed i against seed i; the interval is the 2.5-97.5 '
          f'percentile of the difference over {BOOTSTRAP_SAMPLES} resamples of the seeds and, within each, of '
          'the prompts; `all` pools the prompt sets. AR1 says whether the interval lies above zero (higher), '
          'below (lower) or holds zero (inconclusive).', '',
          paired_table(paired), ''] if paired else []) + ([
          '## The main head: paired differences over seeds', '',
          "Seed i of a row minus seed i of its reference; the interval is the mean's 95% t-interval over "
          'the seeds (the held-out and prompt-set accuracies are measured once per seed).', '',
          main_md, ''] if main_md else []))
  with open(os.path.join(out_dir, 'results.md'), 'w') as f:
    f.write(md)
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump({'rows': {label: runs for label, runs in rows}, 'paired': paired}, f, indent=2)
  if depth_of(rows):
    plot_acceptance(rows, os.path.join(out_dir, 'acceptance.png'))
  plot_loss_curves(rows, run_dirs, os.path.join(out_dir, 'loss_curves.png'))
  return md
