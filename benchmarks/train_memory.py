"""Peak memory of a K=4 vocab-32k MTP-D train step over a K=0 (plain LM) step, from XLA.

  python -m benchmarks.train_memory [--heads=4] [--batch_size=2] [--seq_len=1024] [--fused_chunk_rows=256] [--remat=0]

Nothing runs: each step (train.make_steps, one device) is lowered and compiled, and XLA's memory
analysis of the compiled program gives its bytes. `mem_k4_over_k0` uses temp + argument + output
bytes, as the issue defines it; since the step donates its state, the output aliases the
argument, so `..._no_alias` also reports temp + argument + output - alias (the live peak bound).
`fused/...` measures the steps with the library's default loss (train.loss_chunk_rows=256: from
hidden states in row chunks, fused_loss.mtp_d_loss_fused), which the headline `mem_k4_over_k0`
reports; `logits/...` the loss on full logits (loss_chunk_rows=0). Prints name=value lines and
writes benchmarks/results/train_memory.json.
"""

import types

import jax
from absl import flags

from benchmarks import common


FLAGS = flags.FlagValues()  # this benchmark's own flags: names may repeat across benchmarks
flags.DEFINE_string('config', 'v32k', "'v32k' (d=512, V=32k) or 'tiny' (a smoke run)", flag_values=FLAGS)
flags.DEFINE_integer('heads', 4, 'K of the numerator step', flag_values=FLAGS)
flags.DEFINE_integer('batch_size', 2, 'sequences per step', flag_values=FLAGS)
flags.DEFINE_integer('seq_len', 1024, 'tokens per sequence', flag_values=FLAGS)
flags.DEFINE_integer('fused_chunk_rows', 256, '0: skip the fused loss', flag_values=FLAGS)
flags.DEFINE_integer('remat', 0, '1: model.remat (recompute blocks in the backward)', flag_values=FLAGS)
common.define_results_dir(FLAGS)


def parse_args(argv=None) -> types.SimpleNamespace:
  """The flags from `argv` (default: the command line), every other flag at its default."""
  return common.parse_flags(FLAGS, argv, __doc__)


def step_memory(name: str, num_mtp_heads: int, batch_size: int, seq_len: int, fused_chunk_rows: int = 0,
                remat: bool = False) -> dict:
  """Byte counts of XLA's memory analysis of one compiled train step."""
  mesh = common.one_device_mesh()
  config = common.get_config(name, num_mtp_heads=num_mtp_heads, batch_size=batch_size, seq_len=seq_len)
  config.model.remat = remat
  with jax.set_mesh(mesh):
    m = common.Step(config, mesh, init=False, fused_chunk_rows=fused_chunk_rows).compiled().memory_analysis()
  out = {k: int(getattr(m, f'{k}_size_in_bytes')) for k in ('temp', 'argument', 'output', 'alias', 'generated_code')}
  out['total'] = out['temp'] + out['argument'] + out['output']
  out['total_no_alias'] = out['total'] - out['alias']
  return out


def main(args: types.SimpleNamespace) -> dict:
  k, c = args.heads, args.fused_chunk_rows
  r = bool(args.remat)
  mem = {f'k{k}': step_memory(args.config, k, args.batch_size, args.seq_len, 0, r),
         'k0': step_memory(args.config, 0, args.batch_size, args.seq_len, 0, r)}
  if c:
    mem[f'k{k}_fused'] = step_memory(args.config, k, args.batch_size, args.seq_len, c, r)
    mem['k0_fused'] = step_memory(args.config, 0, args.batch_size, args.seq_len, c, r)
  results = {'config': args.config,
             'method': 'XLA compiled.memory_analysis(): temp + argument + output bytes of the jitted train step',
             'batch_size': args.batch_size, 'seq_len': args.seq_len, 'remat': r, 'bytes': mem}
  for name, m in mem.items():
    results[f'{name}_total_gib'] = m['total'] / 2 ** 30
    results[f'{name}_temp_gib'] = m['temp'] / 2 ** 30

  def ratio(num, den, key='total'):
    return mem[num][key] / mem[den][key]
  results[f'logits/mem_k{k}_over_k0'] = ratio(f'k{k}', 'k0')
  results[f'logits/mem_k{k}_over_k0_no_alias'] = ratio(f'k{k}', 'k0', 'total_no_alias')
  if c:
    results['fused_chunk_rows'] = c
    results[f'fused/mem_k{k}_over_k0'] = ratio(f'k{k}_fused', 'k0_fused')
    results[f'fused/mem_k{k}_over_k0_no_alias'] = ratio(f'k{k}_fused', 'k0_fused', 'total_no_alias')
    results[f'fused/mem_k{k}_over_logits_k0'] = ratio(f'k{k}_fused', 'k0')
  # The headline: the library's default path (the fused loss when measured).
  results[f'mem_k{k}_over_k0'] = results[f'fused/mem_k{k}_over_k0' if c else f'logits/mem_k{k}_over_k0']
  common.write_results('train_memory', results, args.results_dir)
  return results


if __name__ == '__main__':
  from mtpd_jax.harness import cli
  cli.run(lambda: main(parse_args()))  # bad input: one 'error:' line, exit 2
