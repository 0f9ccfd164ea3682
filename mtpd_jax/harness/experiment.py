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
import re

import ml_collections

from mtpd_jax import checkpoint, runtime, workdir_lock
from mtpd_jax.harness import corpus, evaluate, looped, planner, recipe, report, training, validation

SUMMARY = 'summary.json'


def _digest(obj) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _base_seeds(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` with the base LM's seeds: `base.seed` for both init and data order when it is >= 0
  (one base model for every seed of a sweep), else the run's own."""
  c = copy.deepcopy(config)
  if config.base.seed >= 0:
    c.seed, c.data.seed = config.base.seed, config.base.seed
  return c


def base_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The plain LM (K=0) that every variant of `config` continues from."""
  c = _base_seeds(config)
  c.model.num_mtp_heads, c.distill.enabled, c.looped.schedule = 0, False, ()
  c.train.steps, c.train.trainable, c.train.init_from = config.base.steps, 'all', ''
  c.distill.beta, c.eval.enabled = None, False
  return c


def base_workdir(config: ml_collections.ConfigDict, root: str) -> str:
  """runs/_base/<hash of everything the base model depends on>."""
  config = _base_seeds(config)
  key = {k: config[k].to_dict() for k in ('model', 'data')}
  # A base has no heads (K = 0); its key stays what it was before K moved into config.model.
  del key['model']['num_mtp_heads']
  key.update(train={k: v for k, v in config.train.to_dict().items() if k not in ('init_from', 'trainable')},
             seed=config.seed, steps=config.base.steps)
  return os.path.join(root, '_base', _digest(key))


def with_seed(config: ml_collections.ConfigDict, i: int) -> ml_collections.ConfigDict:
  """Seed i of a point: both the initialisation and the data order shift by i."""
  c = copy.deepcopy(config)
  c.seed, c.data.seed = config.seed + i, config.data.seed + i
  return c


def run_places(name: str, arg: str = '', workdir: str | None = None,
               results_dir: str | None = None) -> tuple[str, str]:
  """(workdir, report folder) of a run of config NAME or NAME:arg.

  NAME:arg gets its own runs/NAME-arg and results/NAME-arg, so a smoke run (`:quick`) and the full
  run never share checkpoints or a report. A report lives with its run: given a workdir, the report
  goes to <workdir>/report unless `results_dir` says otherwise.
  """
  label = name + (f'-{re.sub(r"[^A-Za-z0-9_.=+-]", "_", arg)}' if arg else '')
  if workdir is None:
    return os.path.join('runs', label), results_dir or os.path.join('results', label)
  return workdir, results_dir or os.path.join(workdir, 'report')


def with_base(config: ml_collections.ConfigDict, root: str = 'runs') -> ml_collections.ConfigDict:
  """`config` as it trains: continued from its cached base model when `base.steps` > 0."""
  config = copy.deepcopy(config)
  if config.base.steps and not config.train.init_from:
    config.train.init_from = base_workdir(config, root)
  return config


def run_point(config: ml_collections.ConfigDict, workdir: str, *, root: str = 'runs',
              progress: bool = True, plan: list[tuple[ml_collections.ConfigDict, str]] | None = None) -> dict:
  """Train one variant (from the cached base model when `base.steps` > 0), evaluate it, save a summary.

  `plan`: the (config, workdir) of each model it trains (`training_plans`; default its own).
  The workdir is locked throughout (workdir_lock); a shared base model's or plan's workdir while it trains.
  """
  with workdir_lock.hold(workdir):
    return _run_point(config, workdir, root=root, progress=progress, plan=plan)


def _run_point(config, workdir, *, root, progress, plan):
  original, config = config, with_base(config, root)
  if config.train.init_from and config.train.init_from != original.train.init_from:
    bdir = config.train.init_from
    print(f'[base] plain LM, {config.base.steps} steps -> {bdir}', flush=True)
    with workdir_lock.hold(bdir, wait=True):  # another sweep may be training the same base
      training.train_and_evaluate(base_config(config), bdir, progress=progress)
  own = _own_models(config, workdir)
  plan = plan or own
  for (_, d), (_, own_dir) in zip(plan, own):
    if d != own_dir:
      print(f'[shared] {own_dir}: the same model as {d}, trained once there', flush=True)
  _, final = training.train_plan(plan, progress=progress)
  # Evaluated as this point says (its eval.* may differ from the shared model's own run).
  eval_config, model_dir = own[-1][0], plan[-1][1]
  print(format_summary(final, eval_config.model.num_mtp_heads), flush=True)
  summary = {'config': _digest(original.to_json()), 'model_dir': model_dir, 'final': final,
             'eval': evaluate_workdir(model_dir, config=eval_config, out_dir=workdir)
                     if config.eval.enabled else None}
  # Its presence marks the point finished (run_sweep skips it): written whole or not at all.
  runtime.write_atomically(os.path.join(workdir, SUMMARY), json.dumps(evaluate.json_ready(summary), indent=2))
  return summary


# What says how a trained model is evaluated, or how a sweep or looped run derives its runs'
# configs, and not what trains: runs that differ in nothing else train one model.
NOT_TRAINING = ('eval', 'seeds', 'looped')


def _own_models(config: ml_collections.ConfigDict, workdir: str) -> list[tuple[ml_collections.ConfigDict, str]]:
  """(config, workdir) of each model a point trains in its own workdir: its looped stages, else itself."""
  return looped.stage_configs(config, workdir) if config.looped.schedule else [(config, workdir)]


def training_plans(points: list[tuple[ml_collections.ConfigDict, str]], root: str = 'runs'
                   ) -> list[list[tuple[ml_collections.ConfigDict, str]]]:
  """Per (config, workdir) of a sweep's points, the (config, workdir) of each model it trains, in order.

  A model whose training config an earlier point's model has too (the two differ only in
  NOT_TRAINING: a training-free looped row and its trained head, a looped schedule's first stages
  and the row they repeat) trains once, in that earlier point's workdir and with its config. Later
  stages then continue from there. A point whose own workdir for a model already holds checkpoints
  (written before models were shared) keeps it, so an interrupted run resumes as it began.
  """
  owners, plans = {}, []
  for config, workdir in points:
    plan = []
    for i, (c, d) in enumerate(_own_models(with_base(config, root), workdir)):
      if i:
        c.train.init_from = plan[-1][1]  # the previous stage, wherever it trained
      trained = json.loads(c.to_json())
      key = _digest({k: v for k, v in trained.items() if k not in NOT_TRAINING})
      if key in owners and not training.has_checkpoints(d):
        c, d = owners[key]
      owners.setdefault(key, (c, d))
      plan.append((c, d))
    plans.append(plan)
  return plans


def evaluate_workdir(workdir: str, draft_depth: int | None = None, *, write: bool = True,
                     defaults: ml_collections.ConfigDict | None = None,
                     config: ml_collections.ConfigDict | None = None, out_dir: str | None = None) -> dict:
  """Speculative decoding of the workdir's model on its config's prompt sets; writes eval.json/.md/.png
  to `out_dir` (default: the workdir) unless `write` is False (e.g. for another draft depth than the
  run's own report). `config` (default: the workdir's own) says how to evaluate; `defaults` fill
  the fields that a workdir of an older version lacks (training.saved_config).

  Refuses (workdir_lock.WorkdirLocked) a workdir that another process is training.
  """
  with workdir_lock.hold(workdir, create=False):
    return _evaluate_workdir(workdir, draft_depth, write=write, defaults=defaults, config=config,
                             out_dir=out_dir or workdir)


def _evaluate_workdir(workdir, draft_depth, *, write, defaults, config, out_dir):
  model, saved = training.restore_model(workdir, defaults=defaults)
  config = config or saved
  depth = draft_depth or config.eval.draft_depth or config.model.num_mtp_heads
  it = recipe.make_data_iterator(config, 'eval')
  heldout = evaluate.heldout_metrics(model, (next(it) for _ in range(config.train.eval_batches)))
  results = {}
  if depth:
    e = config.eval
    sets = recipe.prompt_sets(config)
    # Heads trained over a head vocabulary draft among its ids, as saved with their checkpoint.
    opts = recipe.decode_options(config, depth, training.head_vocab_of(workdir, saved))
    results = evaluate.evaluate_prompt_sets(model, sets, opts, batch_size=e.batch_size, repeats=e.repeats,
                                            timing_steps=e.timing_steps, timing_repeats=e.timing_repeats,
                                            latency_prompts=e.get('latency_prompts', 0))
    print(evaluate.markdown_table(results), flush=True)
    if e.get('speculation', '') == 'auto':  # the planner's pick, timed against plain on every set
      choice = planner.plan(model, recipe.calibration_prompts(config), opts, batch_size=e.batch_size,
                            cache_dir=os.path.join(config.data.cache_dir or corpus.default_cache_dir(), 'planner'))
      for name, prompts in sets.items():
        results[name]['auto'] = planner.measure(model, prompts, choice, batch_size=e.batch_size, repeats=e.repeats)
  if write:
    evaluate.write_report(results, out_dir, heldout)
  return {'prompt_sets': results, 'heldout': heldout, 'trunk': evaluate.trunk_signature(model.cfg)}


def format_summary(metrics: dict[str, float], num_mtp_heads: int) -> str:
  """Held-out metrics as a small table: one row for the main head, one per MTP head."""
  lines = [f'held-out loss {metrics["eval/loss"]:.4f}',
           f'{"head":>6} {"xent":>8} {"distill":>8} {"agree":>8}',
           f'{"main":>6} {metrics["eval/xent"]:8.4f} {"":>8} {"":>8}']
  for k in range(1, num_mtp_heads + 1):
    kl = metrics.get(f'eval/distill/k{k}/kl')
    lines.append(f'{"k" + str(k):>6} {metrics[f"eval/mtp/k{k}/xent"]:8.4f} '
                 f'{"-" if kl is None else f"{kl:.4f}":>8} {100 * metrics[f"eval/mtp/k{k}/agree"]:7.2f}%')
  return '\n'.join(lines)


# ---------------------------------------------------------------------------------------------
# Sweeps


def sweep_points(sweep: list[dict]) -> list[tuple[str, dict]]:
  """(label, overrides) per point; a point's optional 'label' names its row, else its overrides do.

  A point's optional 'reference' (another point's label) is not an override: see `references`.
  """
  out = []
  for point in sweep:
    point = {k: v for k, v in point.items() if k != 'reference'}
    renamed = [k for k in point if k in validation.RENAMED]
    if renamed:
      raise ValueError(f'sweep point {point.get("label")!r} sets {renamed[0]}, which is now '
                       f'{validation.RENAMED[renamed[0]]}')
    label = point.pop('label', None) or ', '.join(f'{k}={v}' for k, v in point.items()) or 'default'
    out.append((label, point))
  return out


def references(sweep: list[dict]) -> dict[str, str]:
  """Each row's reference for the report's paired differences: its 'reference', else the first row."""
  labels = [label for label, _ in sweep_points(sweep)]
  out = {}
  for label, point in zip(labels, sweep):
    ref = point.get('reference', labels[0])
    if ref not in labels:
      raise ValueError(f"sweep point {label!r} names reference {ref!r}, which is no point's label")
    if ref != label:
      out[label] = ref
  return out


def run_sweep(config: ml_collections.ConfigDict, sweep: list[dict], workdir: str, results_dir: str, *,
              indices=None, root: str = 'runs', progress: bool = True,
              defaults: ml_collections.ConfigDict | None = None) -> str:
  """Run every point (or `indices`) for `config.seeds` seeds, then write the report to `results_dir`.

  A finished point is skipped; `defaults` (configs/base.py's, from an entry point) let a point
  finished by a version that lacked some fields count as finished (`_finished_with`).

  Each point's workdir is locked while it runs, so two processes may run different points of one
  sweep (`--sweep_index`), but never the same one.
  """
  checkpoint.check_options(config.ckpt.every_steps, config.ckpt.max_to_keep)
  points, refs = sweep_points(sweep), references(sweep)
  runs = []
  for i, (label, overrides) in enumerate(points):
    for s in range(config.seeds):
      c = with_seed(config, s)
      c.update_from_flattened_dict(overrides)
      runs.append((i, s, label, c, _point_dir(workdir, i, s, len(points), config.seeds)))
  # Every point's plan, run or not, so that a model is shared the same way whichever points run.
  plans = training_plans([(c, run_dir) for *_, c, run_dir in runs], root)
  runs = [(run, plan) for i in (range(len(points)) if indices is None else indices)
          for run, plan in zip(runs, plans) if run[0] == i]
  for (_, _, _, c, _), _ in runs:
    validation.validate_config(c)  # every point, before any of them starts
  for (i, s, label, c, run_dir), plan in runs:
    tag = f'[{label}{"" if config.seeds == 1 else f" seed {s}"}]'
    summary_path = os.path.join(run_dir, SUMMARY)
    training.check_workdir(with_base(c, root), run_dir)
    if os.path.exists(summary_path):  # a rerun skips finished points, if they are this config's
      with open(summary_path) as f:
        if not _finished_with(json.load(f), c, run_dir, root, defaults):
          raise ValueError(f'{run_dir} holds results of another config; use another --workdir')
      print(f'{tag} finished earlier: {run_dir}', flush=True)
      continue
    print(f'{tag} workdir {run_dir}', flush=True)
    run_point(c, run_dir, root=root, progress=progress, plan=plan)
  return write_sweep_report(config, points, workdir, results_dir, refs)


def _finished_with(summary: dict, config: ml_collections.ConfigDict, run_dir: str, root: str,
                   defaults: ml_collections.ConfigDict | None) -> bool:
  """Whether a point's summary holds results of `config`: the same config digest, or a run of a
  version that lacked some fields, whose config.json matches once those take their `defaults`
  (configs/base.py's: the older version behaved as the default)."""
  if summary.get('config') == _digest(config.to_json()):
    return True
  if defaults is None:
    return False
  try:
    saved = training.saved_config(run_dir).to_dict()
  except (FileNotFoundError, ValueError):
    return False
  current = json.loads(with_base(config, root).to_json())
  return _digest(training.with_defaults(saved, json.loads(defaults.to_json()))) == _digest(current)


def _point_dir(workdir: str, i: int, s: int, num_points: int, num_seeds: int) -> str:
  d = workdir if num_points == 1 else os.path.join(workdir, str(i))
  return d if num_seeds == 1 else os.path.join(d, f'seed{s}')


def write_sweep_report(config: ml_collections.ConfigDict, points, workdir: str, results_dir: str,
                       refs: dict[str, str] | None = None) -> str:
  """The sweep's report from each run's summary.json (rows of points not yet run stay empty)."""
  rows, run_dirs = [], []
  for i, (label, _) in enumerate(points):
    runs, dirs = [], []
    for s in range(config.seeds):
      path = os.path.join(_point_dir(workdir, i, s, len(points), config.seeds), SUMMARY)
      if os.path.exists(path):
        with open(path) as f:
          runs.append({**json.load(f), 'seed': s})  # its id, which pairs it with its reference's seed s
        dirs.append(runs[-1]['model_dir'])
    rows.append((label, runs))
    run_dirs.append(dirs)
  return report.write(rows, run_dirs, results_dir, title=os.path.basename(os.path.normpath(workdir)),
                      num_seeds=config.seeds, references=refs or {},
                      tokens_per_step=config.data.batch_size * config.data.seq_len)
