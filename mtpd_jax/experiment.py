"""The paper's experiment protocol: a cached base model, variants continued from it, seeds, reports.

Every variant of a sweep starts from the same base model (a plain LM pretrained once per model
and data config) with the same seed and data order, so differences between rows are the method's.
After training, each run is evaluated by real speculative decoding on the prompt sets
(`eval.json`, `eval.md`), and the sweep's runs are gathered into one report in the paper's layout.
"""

import copy
import hashlib
import json
import os

import ml_collections
import numpy as np

from mtpd_jax import evaluate, looped, recipe, train

SUMMARY = 'summary.json'


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def base_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The plain LM (K=0) that every variant of `config` continues from."""
  c = copy.deepcopy(config)
  c.mtp.num_heads, c.distill.enabled, c.looped.schedule = 0, False, ()
  c.train.steps, c.train.trainable, c.train.init_from = config.base.steps, 'all', ''
  c.distill.beta, c.eval.enabled = None, False
  return c


def base_workdir(config: ml_collections.ConfigDict, root: str) -> str:
  """runs/_base/<hash of everything the base model depends on>."""
  key = {k: config[k].to_dict() for k in ('model', 'data')}
  key.update(train={k: v for k, v in config.train.to_dict().items() if k not in ('init_from', 'trainable')},
             seed=config.seed, steps=config.base.steps)
  return os.path.join(root, '_base', _digest(key))


def with_seed(config: ml_collections.ConfigDict, i: int) -> ml_collections.ConfigDict:
  """Seed i of a point: both the initialisation and the data order shift by i."""
  c = copy.deepcopy(config)
  c.seed, c.data.seed = config.seed + i, config.data.seed + i
  return c


def run_point(config: ml_collections.ConfigDict, workdir: str, *, root: str = 'runs',
              progress: bool = True) -> dict:
  """Train one variant (from the cached base model when `base.steps` > 0), evaluate it, save a summary."""
  original, config = config, copy.deepcopy(config)
  if config.base.steps and not config.train.init_from:
    bdir = base_workdir(config, root)
    print(f'[base] plain LM, {config.base.steps} steps -> {bdir}', flush=True)
    train.train_and_evaluate(base_config(config), bdir, progress=progress)
    config.train.init_from = bdir
  if config.looped.schedule:
    _, final = looped.run_looped(config, workdir, progress=progress)
    model_dir = looped.stage_configs(config, workdir)[-1][1]
  else:
    _, final = train.train_and_evaluate(config, workdir, progress=progress)
    model_dir = workdir
  num_heads = config.looped.schedule[-1] if config.looped.schedule else config.mtp.num_heads
  print(format_summary(final, num_heads), flush=True)
  summary = {'config': _digest(original.to_json()), 'final': final,
             'eval': evaluate_workdir(model_dir) if config.eval.enabled else None}
  with open(os.path.join(workdir, SUMMARY), 'w') as f:
    json.dump(evaluate.json_ready(summary), f, indent=2)
  return summary


def evaluate_workdir(workdir: str, draft_depth: int | None = None) -> dict:
  """Speculative decoding of the workdir's model on its config's prompt sets; writes eval.json/.md/.png."""
  model, config = train.restore_model(workdir)
  depth = draft_depth or config.eval.draft_depth or config.mtp.num_heads
  it = recipe.make_data_iterator(config, 'eval')
  heldout = evaluate.heldout_metrics(model, (next(it) for _ in range(config.train.eval_batches)))
  results = {}
  if depth:
    e = config.eval
    results = evaluate.evaluate_prompt_sets(model, recipe.prompt_sets(config), draft_depth=depth,
                                            max_new_tokens=e.max_new_tokens, batch_size=e.batch_size,
                                            stop_tokens=(config.data.eos_id,))
    print(evaluate.markdown_table(results), flush=True)
  evaluate.write_report(results, workdir, heldout)
  return {'prompt_sets': results, 'heldout': heldout}


def format_summary(metrics: dict[str, float], num_heads: int) -> str:
  """Held-out metrics as a small table: one row for the main head, one per MTP head."""
  lines = [f'held-out loss {metrics["eval/loss"]:.4f}',
           f'{"head":>6} {"xent":>8} {"kl":>8} {"agree":>8}',
           f'{"main":>6} {metrics["eval/xent"]:8.4f} {"":>8} {"":>8}']
  for k in range(1, num_heads + 1):
    kl = metrics.get(f'eval/distill/k{k}/kl')
    lines.append(f'{"k" + str(k):>6} {metrics[f"eval/mtp/k{k}/xent"]:8.4f} '
                 f'{"-" if kl is None else f"{kl:.4f}":>8} {100 * metrics[f"eval/mtp/k{k}/agree"]:7.2f}%')
  return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------
# Sweeps


def sweep_points(sweep: list[dict]) -> list[tuple[str, dict]]:
  """(label, overrides) per point; a point's optional 'label' names its row, else its overrides do."""
  out = []
  for point in sweep:
    point = dict(point)
    label = point.pop('label', None) or ', '.join(f'{k}={v}' for k, v in point.items()) or 'default'
    out.append((label, point))
  return out


def run_sweep(config: ml_collections.ConfigDict, sweep: list[dict], workdir: str, *,
              indices=None, root: str = 'runs', progress: bool = True) -> str:
  """Run every point (or `indices`) for `config.seeds` seeds, then write and return the report."""
  points = sweep_points(sweep)
  for i in (range(len(points)) if indices is None else indices):
    label, overrides = points[i]
    for s in range(config.seeds):
      c = with_seed(config, s)
      c.update_from_flattened_dict(overrides)
      run_dir = _point_dir(workdir, i, s, len(points), config.seeds)
      tag = f'[{label}{"" if config.seeds == 1 else f" seed {s}"}]'
      summary_path = os.path.join(run_dir, SUMMARY)
      if os.path.exists(summary_path):  # a rerun skips finished points, if they are this config's
        with open(summary_path) as f:
          if json.load(f).get('config') != _digest(c.to_json()):
            raise ValueError(f'{run_dir} holds results of another config; use another --workdir')
        print(f'{tag} finished earlier: {run_dir}', flush=True)
        continue
      print(f'{tag} workdir {run_dir}', flush=True)
      run_point(c, run_dir, root=root, progress=progress)
  return write_sweep_report(config, points, workdir)


def _point_dir(workdir: str, i: int, s: int, num_points: int, num_seeds: int) -> str:
  d = workdir if num_points == 1 else os.path.join(workdir, str(i))
  return d if num_seeds == 1 else os.path.join(d, f'seed{s}')


def _mean_pm(values) -> str:
  values = [v for v in values if v is not None and np.isfinite(v)]
  if not values:
    return '–'
  if len(values) == 1:
    return f'{values[0]:.2f}'
  return f'{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}'


def write_sweep_report(config: ml_collections.ConfigDict, points, workdir: str) -> str:
  """report.md / report.json: one row per point (mean ± std over seeds), from each run's summary.json."""
  rows = []
  for i, (label, _) in enumerate(points):
    runs = []
    for s in range(config.seeds):
      path = os.path.join(_point_dir(workdir, i, s, len(points), config.seeds), SUMMARY)
      if os.path.exists(path):
        with open(path) as f:
          runs.append(json.load(f))
    rows.append((label, runs))
  sets = sorted({n for _, runs in rows for r in runs if r['eval'] for n in r['eval']['prompt_sets']})
  depth = max((len(p['ar']) for _, runs in rows for r in runs if r['eval']
               for p in r['eval']['prompt_sets'].values()), default=0)

  def per_run(runs, fn):
    return [fn(r) for r in runs if r['eval']]

  def mean_over_sets(r, fn, scale=1.0):
    vals = [v for v in map(fn, r['eval']['prompt_sets'].values()) if v is not None]
    return scale * float(np.mean(vals)) if vals else None

  head = ['variant', 'main acc %', 'main loss'] + [f'AR1 {n} %' for n in sets] + ['tokens/fwd', 'speedup']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, runs in rows:
    cells = [label,
             _mean_pm(per_run(runs, lambda r: 100 * r['eval']['heldout']['accuracy'])),
             _mean_pm(per_run(runs, lambda r: r['eval']['heldout']['loss']))]
    for n in sets:
      cells.append(_mean_pm(per_run(runs, lambda r: 100 * r['eval']['prompt_sets'][n]['ar'][0]
                                    if n in r['eval']['prompt_sets'] else None)))
    cells.append(_mean_pm(per_run(runs, lambda r: mean_over_sets(r, lambda p: p['tokens_per_forward']))))
    cells.append(_mean_pm(per_run(runs, lambda r: mean_over_sets(r, lambda p: p['speedup_measured']))))
    lines.append('| ' + ' | '.join(cells) + ' |')
  table = '\n'.join(lines)
  per_head = ['| variant | ' + ' | '.join(f'head {k + 1}' for k in range(depth)) + ' |',
              '|---|' + '---|' * depth]
  for label, runs in rows:
    cells = []
    for k in range(depth):
      car = per_run(runs, lambda r: mean_over_sets(r, lambda p: p['car'][k] if k < len(p['car']) else None, 100))
      ar = per_run(runs, lambda r: mean_over_sets(r, lambda p: p['ar'][k] if k < len(p['ar']) else None, 100))
      cells.append(f'{_mean_pm(car)} / {_mean_pm(ar)}')
    per_head.append(f'| {label} | ' + ' | '.join(cells) + ' |')
  report = '\n'.join([
      f'# {os.path.basename(os.path.normpath(workdir))}', '',
      f'{config.seeds} seed(s) per row (mean ± std). Main head: held-out next-token accuracy and loss. '
      'AR1: acceptance of head 1 under greedy speculative decoding on each prompt set. tokens/fwd: '
      'emitted tokens per main forward (the bonus token counts). speedup: measured wall-clock tokens/s '
      'of speculative over plain greedy decoding of the same model, mean over prompt sets.', '',
      table, '', '## CAR / AR (%) per draft depth, mean over prompt sets', '', '\n'.join(per_head), ''])
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'report.md'), 'w') as f:
    f.write(report)
  with open(os.path.join(workdir, 'report.json'), 'w') as f:
    json.dump(evaluate.json_ready({label: runs for label, runs in rows}), f, indent=2)
  if depth:
    _plot_sweep(rows, depth, os.path.join(workdir, 'report.png'))
  return report


def _plot_sweep(rows, depth: int, path: str) -> None:
  """AR and CAR per draft depth for every row (mean over prompt sets and seeds)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for ax, key, title in zip(axes, ('ar', 'car'), ('AR (conditional) %', 'CAR (cumulative) %')):
    for label, runs in rows:
      curve = [np.mean([100 * p[key][k] for r in runs if r['eval'] for p in r['eval']['prompt_sets'].values()
                        if k < len(p[key]) and p[key][k] is not None] or [np.nan]) for k in range(depth)]
      ax.plot(range(1, depth + 1), curve, marker='o', label=label)
    ax.set(title=title, xlabel='draft depth (head)', ylim=(0, 100))
    ax.grid(alpha=0.3)
  axes[1].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
