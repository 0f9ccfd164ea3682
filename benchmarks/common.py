"""Shared pieces of the train-step benchmarks: configs, a built step, side-by-side timing, results.

Every benchmark runs the library's own train step (`train.abstract_train_state`, `init_train_state`,
`make_steps`) on a one-device mesh with synthetic batches, so what is timed is what trains.
"""

import copy
import datetime
import json
import os
import shlex
import statistics
import sys
import time
import types

import jax
import numpy as np
from absl import flags

from configs import base, tiny
from mtpd_jax import losses, sharding
from mtpd_jax.harness import cli, evaluate, recipe, training

RESULTS_DIR = os.path.join(os.path.dirname(__file__), 'results')
TOP_N_FRACTION = 10_000 / 122_880  # the paper's N / V (≈ 8.1%)


def get_config(name: str, *, num_mtp_heads: int, distill: bool = True, batch_size: int | None = None,
               seq_len: int | None = None):
  """'tiny' (configs/tiny.py) or 'v32k' (d=512, 6 layers, vocab 32,000, T=1024, B=2)."""
  if name == 'tiny':
    c = tiny.get_config()
  elif name == 'v32k':
    c = base.get_config()
    c.model.update(dict(vocab_size=32_000, dim=512, num_layers=6, num_heads=8, num_kv_heads=4,
                        head_dim=64, mlp_dim=1536, max_seq_len=1024))
    c.data.update(dict(seq_len=1024, batch_size=2, synthetic_records=64))
  else:
    raise ValueError(f'unknown benchmark config {name!r}')
  if batch_size:
    c.data.batch_size = batch_size
  if seq_len:
    c.data.seq_len = seq_len
    c.model.max_seq_len = max(c.model.max_seq_len, seq_len)
  c.model.num_mtp_heads = num_mtp_heads
  c.distill.enabled = distill and num_mtp_heads > 0
  c.distill.top_n = max(1, round(TOP_N_FRACTION * c.model.vocab_size))
  c.mesh.shape = (1, 1, 1)
  return c


class Step:
  """A built train step: its jitted function, a live state and one device-resident batch.

  fused_chunk_rows > 0 takes the loss from hidden states in row chunks (train.loss_chunk_rows);
  0 computes it from the full logits. selection overrides distill.selection.
  init=False keeps the state abstract: the step can then be compiled (`compiled`) but not run.
  """

  def __init__(self, config, mesh, *, init: bool = True, fused_chunk_rows: int = 0, selection: str | None = None):
    config = copy.deepcopy(config)
    config.train.loss_chunk_rows = fused_chunk_rows
    if selection:
      config.distill.selection = selection
    self.abstract, shardings = training.abstract_state(config, mesh)
    self.step_fn, _ = training.make_steps(config, mesh, shardings)
    self.state = training.init_state(config, self.abstract, shardings) if init else None
    self.batch = sharding.put_batch(next(recipe.make_data_iterator(config, 'train')), mesh)
    self.tokens = config.data.batch_size * config.data.seq_len
    self._compiled = None
    if init:
      self.run()

  def run(self) -> float:
    """Seconds of one step (dispatch to completion); the state advances."""
    start = time.perf_counter()
    self.state, metrics = self.step_fn(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))
    return time.perf_counter() - start

  def compiled(self):
    """The compiled step."""
    if self._compiled is None:
      self._compiled = self.step_fn.lower(self.state or self.abstract, self.batch).compile()
    return self._compiled


def one_device_mesh():
  return sharding.make_mesh((1, 1, 1), ('data', 'fsdp', 'model'))


def time_side_by_side(steps: dict[str, Step], reps: int, warmup: int = 1) -> dict[str, list[float]]:
  """Step seconds of each variant, run in alternation (v1, v2, ..., v1, v2, ...) after warm-up."""
  for _ in range(warmup):
    for s in steps.values():
      s.run()
  times = {name: [] for name in steps}
  for _ in range(reps):
    for name, s in steps.items():
      times[name].append(s.run())
  return times


def median_ratio(num: list[float], den: list[float]) -> float:
  """Median of the per-repetition ratios (neighbouring runs share the machine's noise)."""
  return statistics.median(a / b for a, b in zip(num, den))


def matmul_flops_per_s(n: int = 2048, reps: int = 5) -> float:
  """Best-of f32 FLOP/s of an n³ matmul: the machine's compute ceiling, measured in-process."""
  a = jax.random.normal(jax.random.key(0), (n, n), np.float32)
  f = jax.jit(lambda x: x @ x)
  jax.block_until_ready(f(a))
  best = float('inf')
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(f(a))
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


def define_results_dir(flag_values: flags.FlagValues) -> None:
  flags.DEFINE_string('results_dir', RESULTS_DIR, 'where <name>.json goes', flag_values=flag_values)


def parse_flags(flag_values: flags.FlagValues, argv, doc: str) -> types.SimpleNamespace:
  """The values of `flag_values` parsed from `argv` (None: the command line); others at their defaults.

  Each benchmark defines its flags in a FlagValues of its own (their names repeat across benchmarks),
  so tests can parse one benchmark's flags several times in one process. `--help` prints them; a
  bad flag or a stray argument raises cli.InputError (one 'error:' line under cli.run).
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  if {'-h', '--help', '--helpshort', '--helpfull'} & set(argv):
    print(doc.strip().splitlines()[0] + '\n\n' + flag_values.get_help())
    sys.exit(0)
  flag_values.unparse_flags()
  try:
    rest = flag_values(['benchmark', *argv])[1:]
  except flags.Error as e:
    raise cli.InputError(str(e)) from None
  if rest:
    raise cli.InputError(f'unexpected arguments {rest}: every setting is a --flag=value')
  return types.SimpleNamespace(**flag_values.flag_values_dict())


def write_results(name: str, results: dict, results_dir: str = RESULTS_DIR) -> str:
  """Print `key=value` for the scalar results and write <results_dir>/<name>.json with the date and command."""
  for k, v in results.items():
    if isinstance(v, (int, float, str, bool)):
      print(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}')
  os.makedirs(results_dir, exist_ok=True)
  path = os.path.join(results_dir, f'{name}.json')
  meta = {'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
          'command': shlex.join(sys.orig_argv),
          'device': str(jax.devices()[0]), 'jax': jax.__version__, 'cpu_count': os.cpu_count(),
          'selections': losses.SELECTIONS}
  with open(path, 'w') as f:
    json.dump(evaluate.json_ready({**results, 'meta': meta}), f, indent=2)
  print(f'wrote {path}')
  return path
