"""Model FLOP/s of the d=512 vocab-32k MTP-D train step over the FLOP/s of a large f32 matmul.

  python -m benchmarks.train_efficiency [--heads=4] [--reps=3] [--batch_size=1] [--seq_len=1024]
                                        [--fused_chunk_rows=256]

Model FLOPs are counted analytically: 6 · (matmul parameters used per token) · tokens, where the
unembedding counts once per predictor (main head + K heads), plus attention scores and values
(12 · B · T² · H · E per block: no causal skipping, as the model computes the full T×S). XLA's
own count (`compiled.cost_analysis()['flops']`) is reported alongside. The ceiling is the best
f32 FLOP/s of an n³ matmul measured in the same process, before and after the steps.
`<path>/flops_fraction` = model FLOPs / median step time / ceiling, for `logits` (the loss on full
logits, train.loss_chunk_rows=0) and `fused` (the library's default: the loss from hidden states in
row chunks, fused_loss.mtp_d_loss_fused, train.loss_chunk_rows=256), timed in alternation; the
headline `flops_fraction` is the default path's. Writes
benchmarks/results/train_efficiency.json.
"""

import statistics
import types

import jax
from absl import flags

from benchmarks import common


FLAGS = flags.FlagValues()  # this benchmark's own flags: names may repeat across benchmarks
flags.DEFINE_string('config', 'v32k', "'v32k' (d=512, V=32k) or 'tiny' (a smoke run)", flag_values=FLAGS)
flags.DEFINE_integer('heads', 4, 'K', flag_values=FLAGS)
flags.DEFINE_integer('distill', 1, '1: MTP-D, 0: CE-only MTP', flag_values=FLAGS)
flags.DEFINE_integer('reps', 3, 'timed steps after one warm-up step', flag_values=FLAGS)
flags.DEFINE_integer('batch_size', 1, 'sequences per step', flag_values=FLAGS)
flags.DEFINE_integer('seq_len', 1024, 'tokens per sequence', flag_values=FLAGS)
flags.DEFINE_integer('matmul_n', 2048, 'size of the reference matmul', flag_values=FLAGS)
flags.DEFINE_integer('fused_chunk_rows', 256, '0: skip the fused loss', flag_values=FLAGS)
common.define_results_dir(FLAGS)


def parse_args(argv=None) -> types.SimpleNamespace:
  """The flags from `argv` (default: the command line), every other flag at its default."""
  return common.parse_flags(FLAGS, argv, __doc__)


def model_flops(config) -> float:
  """Analytic FLOPs of one train step (forward + backward) of the MTP transformer."""
  m, k = config.model, config.model.num_mtp_heads
  d, h, g, e, f, v = m.dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
  b, t = config.data.batch_size, config.data.seq_len
  block = d * h * e + 2 * d * g * e + h * e * d + 3 * d * f   # matmul weights of one block
  per_token = m.num_layers * block + k * (block + 2 * d * d) + (k + 1) * d * v
  attention = 12 * b * t * t * h * e * (m.num_layers + k)
  return 6.0 * per_token * b * t + attention


def main(args: types.SimpleNamespace) -> dict:
  config = common.get_config(args.config, num_mtp_heads=args.heads, distill=bool(args.distill),
                             batch_size=args.batch_size, seq_len=args.seq_len)
  ceiling_before = common.matmul_flops_per_s(args.matmul_n)
  mesh = common.one_device_mesh()
  with jax.set_mesh(mesh):
    steps = {'logits': common.Step(config, mesh)}
    if args.fused_chunk_rows:
      steps['fused'] = common.Step(config, mesh, fused_chunk_rows=args.fused_chunk_rows)
    xla_flops = {k: float(s.compiled().cost_analysis()['flops']) for k, s in steps.items()}
    times = common.time_side_by_side(steps, args.reps)
  ceiling_after = common.matmul_flops_per_s(args.matmul_n)
  ceiling = max(ceiling_before, ceiling_after)
  flops = model_flops(config)
  results = {
      'flops_method': 'analytic: 6*matmul_params_per_token*tokens (unembedding once per predictor) '
                      '+ 12*B*T^2*H*E per block; XLA cost_analysis flops reported as xla_flops',
      'config': args.config, 'heads': args.heads, 'distill': bool(args.distill), 'batch_size': args.batch_size,
      'seq_len': args.seq_len, 'times_s': times, 'model_flops': flops, 'xla_flops': xla_flops,
      'matmul_flops_per_s': ceiling, 'matmul_flops_per_s_before_after': [ceiling_before, ceiling_after],
  }
  for name, t in times.items():
    step_s = statistics.median(t)
    results[f'{name}/step_s'] = step_s
    results[f'{name}/model_flops_per_s'] = flops / step_s
    results[f'{name}/flops_fraction'] = flops / step_s / ceiling
    results[f'{name}/xla_flops_fraction'] = xla_flops[name] / step_s / ceiling
  # The headline: the library's default path (the fused loss when measured).
  results['flops_fraction'] = results[f'{"fused" if "fused" in times else "logits"}/flops_fraction']
  common.write_results('train_efficiency', results, args.results_dir)
  return results


if __name__ == '__main__':
  from mtpd_jax.harness import cli
  cli.run(lambda: main(parse_args()))  # bad input: one 'error:' line, exit 2
