"""Train (and evaluate) one config or every point of its sweep.

  python -m experiments.run --config=NAME [--model=PRESET] [--config.a.b=v ...] [--sweep_index=i[,j...]] [--workdir=DIR] [--results_dir=DIR]

NAME resolves to configs/NAME.py (a path works too); `NAME:arg` passes `arg` to get_config.
PRESET (also spelled --config.model=PRESET) takes the architecture from configs/model/PRESET.py,
e.g. moe_tiny; --config.model.* overrides on the command line still apply on top of it.
Rerunning the same command resumes from the latest checkpoint in the workdir.
"""

import copy
import importlib.util
import inspect
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/NAME.py or NAME', lock_config=True)
_SWEEP_INDEX = flags.DEFINE_list('sweep_index', None, 'run only these points of get_sweep() (comma-separated '
                                 'indices); the report still has a row for every point')
_WORKDIR = flags.DEFINE_string('workdir', None, 'default: runs/NAME (NAME:arg: runs/NAME-arg); points of a sweep '
                               'in its subfolders i/')
_RESULTS_DIR = flags.DEFINE_string('results_dir', None, 'the report; default: results/NAME (NAME:arg: '
                                   'results/NAME-arg), or WORKDIR/report with --workdir')
_MODEL = flags.DEFINE_string('model', None, 'model preset configs/model/PRESET.py (e.g. moe_tiny, dense_2b)')


def resolve_config_arg(value: str) -> str:
  """'tiny' -> '<repo>/configs/tiny.py'; paths and 'path:arg' forms pass through."""
  name, sep, arg = value.partition(':')
  if not name.endswith('.py') and os.sep not in name:
    name = os.path.join(CONFIG_DIR, name + '.py')
  if not os.path.isfile(name):
    raise FileNotFoundError(f'config file {name} does not exist')
  from mtpd_jax.harness import cli
  cli.check_config_file(name, arg)  # a syntax error or a wrong ':arg' is named here, not in a traceback
  return name + sep + arg


def _rewrite_argv(argv: list[str]) -> list[str]:
  out = []
  for a in argv:
    if a.startswith('--config='):
      a = '--config=' + resolve_config_arg(a[len('--config='):])
    elif a.startswith('--config.model='):  # a preset name, not a value of the ConfigDict
      a = '--model=' + a[len('--config.model='):]
    out.append(a)
  return out


def config_name(path: str) -> str:
  return os.path.splitext(os.path.basename(path.partition(':')[0]))[0]


def load_config_module(path: str):
  """The config file at `path` (a ':arg' suffix is ignored), imported as a module."""
  spec = importlib.util.spec_from_file_location('_config_module', path.partition(':')[0])
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_sweep(path: str) -> list[dict]:
  """get_sweep() of the config module (given the ':arg' if it takes one), or one empty point."""
  module = load_config_module(path)
  if not hasattr(module, 'get_sweep'):
    return [{}]
  takes_arg = bool(inspect.signature(module.get_sweep).parameters)
  return module.get_sweep(path.partition(':')[2]) if takes_arg else module.get_sweep()


def with_model_preset(config, name: str, overrides: dict):
  """`config` with the architecture of configs/model/NAME.py, then the command line's model overrides."""
  from configs import model as model_presets
  model_presets.apply(config, name)
  config.update_from_flattened_dict({k: v for k, v in overrides.items() if k.startswith('model.')})
  return config


def use_compilation_cache() -> None:
  """XLA's persistent cache in <cache dir>/xla, unless $JAX_COMPILATION_CACHE_DIR names another.

  A sweep's variants and a looped run's stages compile many identical programs, and a rerun all
  of them; each is compiled once per machine. JAX_ENABLE_COMPILATION_CACHE=false turns it off.
  """
  import jax
  from mtpd_jax.harness import corpus
  if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    jax.config.update('jax_compilation_cache_dir', os.path.join(corpus.default_cache_dir(), 'xla'))
  if not os.environ.get('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'):
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def sweep_indices(values: list[str], num_points: int, name: str) -> list[int]:
  """--sweep_index's values as distinct point indices in order, each checked against the sweep."""
  indices = []
  for v in values:
    if not v.strip().isdigit() or int(v) >= num_points:
      raise ValueError(f'--sweep_index={v} is not a point of {name}: it has points 0 to {num_points - 1}')
    if int(v) not in indices:
      indices.append(int(v))
  if not indices:
    raise ValueError(f'--sweep_index names no point of {name}')
  return indices


def maybe_initialize_distributed() -> None:
  """Join a multi-process run when the environment describes one (JAX_COORDINATOR_ADDRESS etc.)."""
  import jax
  if 'JAX_COORDINATOR_ADDRESS' in os.environ:
    jax.distributed.initialize(os.environ['JAX_COORDINATOR_ADDRESS'],
                               int(os.environ['JAX_NUM_PROCESSES']), int(os.environ['JAX_PROCESS_ID']))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  from mtpd_jax.harness import experiment  # after flag parsing, so --help stays fast
  use_compilation_cache()
  maybe_initialize_distributed()
  path = flags.FLAGS['config'].config_filename
  name = config_name(path)
  sweep = load_sweep(path)
  indices = None if _SWEEP_INDEX.value is None else sweep_indices(_SWEEP_INDEX.value, len(sweep), name)
  config = copy.deepcopy(_CONFIG.value)
  overrides = config_flags.get_override_values(flags.FLAGS['config'])
  if _MODEL.value:
    config = with_model_preset(config, _MODEL.value, overrides)
  from mtpd_jax.harness import pretrained
  pretrained.derive_model(config, set(overrides))  # a pretrained init_from gives the model's shape
  from mtpd_jax.harness import validation
  validation.check_fields(config)  # e.g. seeds=0 would run nothing; each sweep point is validated in full later
  validation.check_decoding_fits(config)
  workdir, results_dir = experiment.run_places(name, path.partition(':')[2], _WORKDIR.value, _RESULTS_DIR.value)
  from configs import base
  report = experiment.run_sweep(config, sweep, workdir, results_dir, indices=indices, defaults=base.get_config())
  print(report, flush=True)
  print(f'wrote {results_dir}/results.md, data.json, results.json, acceptance.png, loss_curves.png', flush=True)


def run():
  """The entry point: bad input is one `error:` line and exit 2 (mtpd_jax/harness/cli.py)."""
  from mtpd_jax.harness import cli

  def body():
    sys.argv = _rewrite_argv(sys.argv)
    app.run(main, flags_parser=cli.parse_absl_flags)
  cli.run(body)


if __name__ == '__main__':
  run()
