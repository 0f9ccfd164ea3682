"""Evaluate a trained workdir: speculative-decoding AR/CAR and speedups per prompt set, held-out loss.

  python -m experiments.evaluate --workdir=DIR [--draft_depth=8]

The prompt sets and decoding lengths come from the workdir's config (`eval.*`, see
mtpd_jax.harness.recipe.prompt_sets); a draft depth above K reuses head ((j-1) mod K)+1 (MTP-D* of Table 8).
Writes eval.json, eval.md and eval.png into the workdir and prints name=value lines.
"""

import json
import math
import os

from absl import app, flags, logging


def _define_flags() -> None:
  """This entry point's flags, defined when it runs (not on import), so that a process that also
  imports experiments.run (tests do) does not define --workdir twice."""
  flags.DEFINE_string('workdir', None, 'a training workdir (config.json + checkpoints)', required=True)
  flags.DEFINE_integer('draft_depth', 0, 'drafts per step; 0 = eval.draft_depth or K')


def _fmt(x) -> str:
  return 'nan' if isinstance(x, float) and math.isnan(x) else f'{x:.4f}' if isinstance(x, float) else str(x)


def check_inputs(workdir: str, draft_depth: int) -> None:
  """The workdir, its config.json and the files that config names, before any work."""
  from configs import base
  from mtpd_jax import train
  from mtpd_jax.harness import cli, training, validation
  if draft_depth < 0:
    raise cli.InputError(f'--draft_depth={draft_depth} must be >= 0 (0 = eval.draft_depth or K)')
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f'--workdir={workdir} is not a directory')
  try:
    config = training.saved_config(workdir, base.get_config())
  except json.JSONDecodeError as e:
    raise cli.InputError(f'{os.path.join(workdir, train.CONFIG_JSON)}:{e.lineno}: not valid JSON ({e.msg})') from None
  heads = config.model.num_mtp_heads
  if draft_depth and not heads:
    raise cli.InputError(f'--draft_depth={draft_depth}: the model of {workdir} has no MTP heads to draft with')
  validation.validate_config(config, mesh=False)  # evaluation builds its own mesh
  if not training.has_checkpoints(workdir):
    raise FileNotFoundError(f'{workdir} holds no checkpoint to evaluate')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  from configs import base
  from mtpd_jax.harness import experiment  # after flag parsing, so --help stays fast
  workdir, draft_depth = flags.FLAGS.workdir, flags.FLAGS.draft_depth
  check_inputs(workdir, draft_depth)
  out = experiment.evaluate_workdir(workdir, draft_depth or None, defaults=base.get_config())
  for name, r in out['prompt_sets'].items():
    for k, (ar, car) in enumerate(zip(r['ar'], r['car']), 1):
      print(f'eval/{name}/ar/k{k}={_fmt(ar)} eval/{name}/car/k{k}={_fmt(car)}')
    print(' '.join(f'eval/{name}/{key}={_fmt(r[key])}' for key in (
        'accept_len', 'tokens_per_forward', 'verify_cost_ratio', 'speedup_measured', 'speedup_analytic',
        'lossless')))
  heldout = out['heldout']
  print(f"eval/heldout/loss={heldout['loss']:.4f} eval/heldout/accuracy={heldout['accuracy']:.4f}")
  print(f'wrote {workdir}/eval.json, eval.md, eval.png', flush=True)


def run():
  """The entry point: bad input is one `error:` line and exit 2 (mtpd_jax/harness/cli.py)."""
  from mtpd_jax.harness import cli
  _define_flags()
  cli.run(lambda: app.run(main, flags_parser=cli.parse_absl_flags))


if __name__ == '__main__':
  run()
