"""Head training on SmolLM2's frozen trunk against CPU minutes: which recipe buys acceptance cheapest.

  python -m benchmarks.head_training [--variants=full,head_vocab,teacher_cache,regenerated]
      [--steps=600] [--eval_every=100] [--regenerate_prompts=600] [--workdir=runs/head_training]
      [--name=head_training]

Variants of `smollm2_mtpd:cpu`'s MTP-D row (K=2 fresh heads on the frozen trunk, 4 x 256 tokens per
step), each one step further than the last: `full` (today's recipe: heads over all 49,152 ids,
the main head's Top-N computed every step), `head_vocab` (heads over the 4,096 most frequent
training ids, mtp.head_vocab, with N = 332, 8.1% of them), `teacher_cache` (and the frozen main
head's teacher cached once per position, train.teacher_cache), `regenerated` (and the training
text SmolLM2's own greedy answers, data.regenerate). For each: the wall time of every one-off
phase (regenerating, the trunk-state cache, the teacher cache inside training), then a curve of
held-out head-1 and head-2 agreement (the training loop's evaluations, every `eval_every` steps)
against cumulative CPU minutes, and at the end the online greedy acceptance on 16 calibration
prompts (chat, code and math prompts 64 and on: none of the 64 per set the recipe evaluates).
Writes benchmarks/results/<name>.json and a plot beside it. Variants run one after another in one
process, alone on the machine for comparable times.
"""

import json
import os
import time
import types

import jax
import numpy as np
from absl import flags

from benchmarks import common
from configs import smollm2_mtpd
from mtpd_jax import decode, metrics, sharding, train
from mtpd_jax.harness import prompts, recipe, regenerate, training, trunk_cache

FLAGS = flags.FlagValues()
flags.DEFINE_string('variants', 'full,head_vocab,teacher_cache,regenerated', 'which variants, in order', flag_values=FLAGS)
flags.DEFINE_integer('steps', 600, 'training steps of each variant (full: a quarter, head_vocab: a third)',
                     flag_values=FLAGS)
flags.DEFINE_integer('eval_every', 100, 'steps between held-out evaluations', flag_values=FLAGS)
flags.DEFINE_integer('head_vocab', 4096, 'U of the head-vocabulary variants', flag_values=FLAGS)
flags.DEFINE_integer('regenerate_prompts', 600, 'user turns SmolLM2 answers for `regenerated`', flag_values=FLAGS)
flags.DEFINE_string('workdir', os.path.join('runs', 'head_training'), 'the variants\' workdirs', flag_values=FLAGS)
flags.DEFINE_string('name', 'head_training', 'results file name', flag_values=FLAGS)
common.define_results_dir(FLAGS)

VARIANTS = ('full', 'head_vocab', 'teacher_cache', 'regenerated')
CALIBRATION = {'chat': 6, 'code': 5, 'math': 5}  # prompts 64.. of each set: past the recipe's 64


def parse_args(argv=None) -> types.SimpleNamespace:
  args = common.parse_flags(FLAGS, argv, __doc__)
  args.variants = [v for v in args.variants.split(',') if v]
  unknown = set(args.variants) - set(VARIANTS)
  if unknown:
    raise ValueError(f'--variants: unknown {sorted(unknown)}; expected some of {VARIANTS}')
  return args


def variant_config(name: str, args):
  """The MTP-D row of smollm2_mtpd:cpu with what `name` adds."""
  c = smollm2_mtpd.get_config('cpu')
  c.distill.enabled = True
  # The two slow variants run a part of the steps: enough for their cost per step and first points.
  c.train.steps = max(args.steps // {'full': 4, 'head_vocab': 3}.get(name, 1), args.eval_every)
  c.train.eval_every, c.ckpt.every_steps = args.eval_every, c.train.steps
  c.eval.enabled = False
  if name != 'full':
    c.mtp.head_vocab, c.distill.top_n = args.head_vocab, round(args.head_vocab * common.TOP_N_FRACTION)
  c.train.teacher_cache = name in ('teacher_cache', 'regenerated')
  if name == 'regenerated':
    c.data.regenerate, c.data.regenerate_prompts = True, args.regenerate_prompts
  return c


def _timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def build_trunk_cache(config) -> float:
  """Seconds to build the trunk-state cache of `config`'s records (0 when it exists)."""
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  plain = recipe.make_trunk_cache(config)
  plain.teacher = None  # the teacher builds inside training, where its time is counted
  with jax.set_mesh(mesh):
    abstract, shardings = training.abstract_state(config, mesh)
    state = training.warm_start(config, abstract, shardings, mesh=mesh)
    sources = {s: recipe.make_source(config, s) for s in trunk_cache.SPLITS}
    _, seconds = _timed(lambda: plain.build(state.graphdef, state.params, sources))
  return seconds


def calibration_prompts(config) -> list[np.ndarray]:
  tok = recipe.embedded_data(config).tokenizer()
  out = []
  for name, n in CALIBRATION.items():
    out += prompts.load_prompt_set(name, tokenizer=tok, max_prompts=64 + n,
                                   max_prompt_tokens=config.eval.max_prompt_tokens, chat_template=name == 'chat')[64:]
  return out


def online_acceptance(config, workdir: str) -> dict:
  """Greedy speculative decoding of the calibration prompts at depth K over the heads' vocabulary."""
  model, saved = training.restore_model(workdir)
  ids = training.head_vocab_of(workdir, saved)
  ids = ids if ids is not None else recipe.frequent_training_tokens(saved, 4096)
  tok = recipe.embedded_data(config).tokenizer()
  out = decode.generate(model, calibration_prompts(config), max_new_tokens=config.eval.max_new_tokens,
                        draft_depth=config.model.num_mtp_heads, stop_tokens=tok.stop_ids, draft_vocab=ids)
  return metrics.acceptance_stats(np.concatenate(out.accept_lengths), config.model.num_mtp_heads)


def run_variant(name: str, args, fixed: dict) -> dict:
  config = variant_config(name, args)
  workdir = os.path.join(args.workdir, name)
  phases = dict(fixed)
  if name == 'regenerated':
    _, phases['regenerate_s'] = _timed(lambda: regenerate.build(
        config, lambda: training.answering_model(config)))
    phases['trunk_cache_s'] = build_trunk_cache(config)  # the regenerated records' own states
  _, phases['train_s'] = _timed(lambda: training.train_and_evaluate(config, workdir))
  with open(os.path.join(workdir, train.METRICS)) as f:
    lines = [json.loads(line) for line in f]
  before = sum(v for k, v in phases.items() if k != 'train_s')
  curve = [{'step': r['step'], 'cpu_min': (before + r['elapsed_s']) / 60,
            **{f'agree_k{k}': r[f'eval/mtp/k{k}/agree'] for k in (1, 2)}}
           for r in lines if 'eval/mtp/k1/agree' in r]
  steps = [r for r in lines if 'train/loss' in r]
  step_s = (steps[-1]['elapsed_s'] - steps[0]['elapsed_s']) / max(steps[-1]['step'] - steps[0]['step'], 1)
  online, phases['calibration_s'] = _timed(lambda: online_acceptance(config, workdir))
  return {'phases_s': phases, 'step_s': step_s, 'curve': curve, 'calibration': online,
          'records': len(recipe.make_source(config, 'train')), 'steps': config.train.steps}


def plot(results: dict, path: str) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  for ax, k in zip(axes, (1, 2)):
    for name, r in results['variants'].items():
      ax.plot([p['cpu_min'] for p in r['curve']], [100 * p[f'agree_k{k}'] for p in r['curve']], 'o-', label=name)
    ax.set(title=f'head {k}: held-out agreement with the main head', xlabel='CPU minutes (2 cores)')
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('%')
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> dict:
  args = parse_args(argv)
  fixed = {'trunk_cache_s': build_trunk_cache(variant_config('head_vocab', args))}  # the corpus's records
  results = {'variants': {}}
  for name in args.variants:
    print(f'[{name}]', flush=True)
    results['variants'][name] = run_variant(name, args, fixed if name != 'regenerated' else {})
    print(json.dumps(results['variants'][name]['phases_s']), results['variants'][name]['calibration'], flush=True)
  path = common.write_results(args.name, results, args.results_dir)
  plot(results, path.replace('.json', '.png'))
  return results


if __name__ == '__main__':
  from mtpd_jax.harness import cli
  cli.run(main)
