"""Train-step time of MTP-D over CE-only MTP, measured side by side in one process.

  python -m benchmarks.train_overhead [--configs=tiny,v32k] [--heads=1,4] [--reps=3]
      [--selections=threshold,top_k] [--fused_chunk_rows=256] [--batch_size=1] [--name=train_overhead]

For each config and K, builds the library's own train step (train.make_steps) several ways:
plain MTP (distill.enabled=False) and MTP-D (Top-N = 8.1% of V, the paper's 10,000/122,880)
once per Top-N selection, all with the loss on full logits (losses.mtp_d_loss, train.loss_chunk_rows=0); and, if
fused_chunk_rows > 0, MTP and MTP-D again with the fused loss (train.loss_chunk_rows:
fused_loss.mtp_d_loss_fused from hidden states). After one warm-up step each, the variants run in
alternation `reps` times; each ratio is the median of its per-round ratios (neighbouring runs
share the machine's noise). `mtpd_over_mtp` is the library's default path: the fused loss
(train.loss_chunk_rows > 0) with the first selection; `logits/mtpd_over_mtp` the same selection
with the loss on full logits. Prints name=value lines, writes
benchmarks/results/<name>.json (~7 minutes on 2 busy cores with the defaults).
"""

import statistics
import types

import jax
from absl import flags

from benchmarks import common


FLAGS = flags.FlagValues()  # this benchmark's own flags: names may repeat across benchmarks
flags.DEFINE_string('configs', 'tiny,v32k', "'tiny' (configs/tiny.py), 'v32k' (d=512, V=32k, T=1024)",
                    flag_values=FLAGS)
flags.DEFINE_string('heads', '1,4', 'values of K', flag_values=FLAGS)
flags.DEFINE_string('selections', 'threshold', "MTP-D Top-N selections: 'threshold', 'top_k'", flag_values=FLAGS)
flags.DEFINE_integer('reps', 3, 'alternating timed rounds after warm-up', flag_values=FLAGS)
flags.DEFINE_integer('batch_size', 1, 'v32k batch (tiny keeps its own 8)', flag_values=FLAGS)
flags.DEFINE_integer('seq_len', 0, 'v32k sequence length (0: 1024)', flag_values=FLAGS)
flags.DEFINE_integer('fused_chunk_rows', 256, '0: skip the fused loss', flag_values=FLAGS)
flags.DEFINE_string('name', 'train_overhead', 'results file name', flag_values=FLAGS)
common.define_results_dir(FLAGS)


def parse_args(argv=None) -> types.SimpleNamespace:
  """The flags from `argv` (default: the command line), every other flag at its default."""
  return common.parse_flags(FLAGS, argv, __doc__)


def measure(name: str, num_mtp_heads: int, selections: list[str], reps: int, batch_size: int, seq_len: int,
            fused_chunk_rows: int) -> dict:
  """Step seconds of MTP and of MTP-D per selection (and fused), and their median ratios."""
  mesh = common.one_device_mesh()
  kw = dict(num_mtp_heads=num_mtp_heads, batch_size=batch_size if name == 'v32k' else None, seq_len=seq_len or None)
  with jax.set_mesh(mesh):
    steps = {'mtp': common.Step(common.get_config(name, distill=False, **kw), mesh)}
    for sel in selections:
      steps[f'mtpd_{sel}'] = common.Step(common.get_config(name, **kw), mesh, selection=sel)
    if fused_chunk_rows:
      steps['mtp_fused'] = common.Step(common.get_config(name, distill=False, **kw), mesh,
                                       fused_chunk_rows=fused_chunk_rows)
      steps['mtpd_fused'] = common.Step(common.get_config(name, **kw), mesh, fused_chunk_rows=fused_chunk_rows)
    times = common.time_side_by_side(steps, reps)
  config = common.get_config(name, **kw)
  out = {'vocab_size': config.model.vocab_size, 'top_n': config.distill.top_n,
         'batch_size': config.data.batch_size, 'seq_len': config.data.seq_len,
         'step_s': {k: statistics.median(v) for k, v in times.items()}, 'times_s': times}
  for sel in selections:
    out[f'mtpd_{sel}_over_mtp'] = common.median_ratio(times[f'mtpd_{sel}'], times['mtp'])
  if fused_chunk_rows:
    out['fused/mtpd_over_mtp'] = common.median_ratio(times['mtpd_fused'], times['mtp_fused'])
    out['fused/mtp_over_current_mtp'] = common.median_ratio(times['mtp_fused'], times['mtp'])
    out['fused/mtpd_over_current_mtp'] = common.median_ratio(times['mtpd_fused'], times['mtp'])
  return out


def main(args: types.SimpleNamespace) -> dict:
  selections = args.selections.split(',')
  results = {'reps': args.reps, 'selections': selections, 'fused_chunk_rows': args.fused_chunk_rows, 'runs': {}}
  for name in args.configs.split(','):
    for k in map(int, args.heads.split(',')):
      r = measure(name, k, selections, args.reps, args.batch_size, args.seq_len, args.fused_chunk_rows)
      results['runs'][f'{name}/k{k}'] = r
      for key, v in r['step_s'].items():
        results[f'{name}/k{k}/{key}_step_s'] = v
      for sel in selections:
        results[f'{name}/k{k}/mtpd_{sel}_over_mtp'] = r[f'mtpd_{sel}_over_mtp']
      for key in [k_ for k_ in r if k_.startswith('fused/')]:
        results[f'{name}/k{k}/{key}'] = r[key]
      # The headline: the library's default path, the fused loss (if measured) with the first selection.
      results[f'{name}/k{k}/logits/mtpd_over_mtp'] = r[f'mtpd_{selections[0]}_over_mtp']
      results[f'{name}/k{k}/mtpd_over_mtp'] = r.get('fused/mtpd_over_mtp', r[f'mtpd_{selections[0]}_over_mtp'])
      print(f'{name}/k{k}/mtpd_over_mtp={results[f"{name}/k{k}/mtpd_over_mtp"]:.4g}', flush=True)
  common.write_results(args.name, results, args.results_dir)
  return results


if __name__ == '__main__':
  from mtpd_jax.harness import cli
  cli.run(lambda: main(parse_args()))  # bad input: one 'error:' line, exit 2
