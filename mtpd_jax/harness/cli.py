"""One error path for every entry point: experiments.run / evaluate, the benchmarks, the GGUF tools.

An expected error (a bad flag, config value or file, a non-finite loss, no readable checkpoint)
prints one `error: ...` line on stderr and exits with status 2. Anything else is a bug: one line
that says so and exit status 1; `--verbose` (accepted by every entry point) prints the traceback
too. A run stopped by SIGTERM/SIGINT after its checkpoint exits with 128+signal. Light imports
only, so `--help` stays fast.
"""

import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable

EXIT_BAD_INPUT = 2
EXIT_BUG = 1


class InputError(ValueError):
  """Bad input found by an entry point itself (a flag, a config file); its message is the one line."""


# Exception types that mean bad input or a known stop rather than a bug. FloatingPointError is
# the training loop's stop on a non-finite loss (train.on_nan='stop').
EXPECTED = (ValueError, OSError, KeyError, FloatingPointError)


def is_expected(e: BaseException) -> bool:
  # checkpoint.py raises RuntimeError when every checkpoint of a workdir is damaged.
  return isinstance(e, EXPECTED) or (isinstance(e, RuntimeError) and 'no readable checkpoint' in str(e))


def one_line(e: BaseException) -> str:
  """The message of `e` on one line; for an error that only wraps another's traceback text (ml_collections
  wraps a config file's exception so), the innermost exception's message."""
  text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
  if 'Traceback (most recent call last)' in text:
    inner = e
    while inner.__cause__ is not None or (inner.__context__ is not None and not inner.__suppress_context__):
      inner = inner.__cause__ or inner.__context__
    head = text.split('Error whilst parsing config file')[0].rstrip(': \n')
    text = f'{head + ": " if head else ""}{type(inner).__name__}: {inner}'
  lines = [line.strip() for line in str(text).splitlines() if line.strip()]
  return ' '.join(lines) or type(e).__name__


def _clear_progress_bars() -> None:
  """Erase a running tqdm bar (a run stopped mid-training), so the error line starts a line of its own."""
  tqdm = sys.modules.get('tqdm')
  for bar in list(getattr(getattr(tqdm, 'tqdm', None), '_instances', ())):
    bar.leave = False
    bar.close()


def report(e: BaseException, verbose: bool) -> int:
  """Print `e` as one line (after its traceback when `verbose`); returns the exit status."""
  _clear_progress_bars()
  if verbose:
    traceback.print_exception(e)
  if is_expected(e):
    print(f'error: {one_line(e)}', file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT
  print(f'error: {type(e).__name__}: {one_line(e)} (an unexpected error; rerun with --verbose for the traceback)',
        file=sys.stderr, flush=True)
  return EXIT_BUG


def run(fn: Callable[[], object]) -> None:
  """Run an entry point's body under the shared error handling and exit; `--verbose` is taken from argv."""
  verbose = '--verbose' in sys.argv
  sys.argv = [a for a in sys.argv if a != '--verbose']
  try:
    fn()
  except SystemExit:
    raise
  except KeyboardInterrupt:
    print('error: interrupted', file=sys.stderr)
    sys.exit(130)
  except Exception as e:  # pylint: disable=broad-except
    if type(e).__name__ == 'Preempted' and hasattr(e, 'signum'):  # runtime.Preempted, checkpoint saved
      print(e, file=sys.stderr, flush=True)
      sys.exit(128 + e.signum)
    sys.exit(report(e, verbose))
  sys.exit(0)


def parse_absl_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (for app.run's flags_parser); a bad or missing flag raises InputError."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  try:
    return flags.FLAGS(argv)
  except (flags.Error, KeyError, AttributeError, ValueError, TypeError) as e:
    raise InputError(_override_error(argv, e) or one_line(e)) from e


def _override_error(argv: list[str], e: BaseException) -> str | None:
  """The line for a `--config.*` override that names no field: a renamed one, or a missing key."""
  from mtpd_jax.harness.validation import RENAMED  # pylint: disable=import-outside-toplevel
  fields = [a.split('=', 1)[0].removeprefix('--config.') for a in argv if a.startswith('--config.')]
  for name in fields:
    if name in RENAMED:
      return f'--config.{name} is now --config.{RENAMED[name]}'
  # ml_collections raises AttributeError(KeyError(name)) for a field a locked config lacks.
  candidates = (e, *e.args, e.__context__)
  key_error = next((x for x in candidates if isinstance(x, KeyError) and x.args), None)
  if key_error is not None:
    missing, *hint = [line.strip('\'" ') for line in str(key_error.args[0]).splitlines()]
    for name in fields:
      if missing in name.split('.'):
        return '. '.join([f'--config.{name}: the config has no field {missing!r}', *hint])
  return None


def check_config_file(path: str, arg: str = '') -> None:
  """Import a config file and call its get_config(arg) once, so that a syntax error, a missing or
  unexpected argument, or a result that is not a ConfigDict is named here, not hidden in a traceback."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  try:
    with open(path, encoding='utf-8') as f:
      source = f.read()
    compile(source, path, 'exec')
  except SyntaxError as e:
    raise InputError(f'config file {path}:{e.lineno}: {e.msg}') from None
  except UnicodeDecodeError as e:
    raise InputError(f'config file {path} is not UTF-8 text ({e.reason} at byte {e.start})') from None
  spec = importlib.util.spec_from_file_location('_checked_config', path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except
    raise InputError(f'config file {path} failed to import: {type(e).__name__}: {one_line(e)}') from e
  get_config = getattr(module, 'get_config', None)
  if not callable(get_config):
    raise InputError(f'config file {path} defines no get_config()')
  takes_arg = bool(inspect.signature(get_config).parameters)
  name = os.path.splitext(os.path.basename(path))[0]
  if arg and not takes_arg:
    raise InputError(f"config file {path}: its get_config() takes no argument, so '{name}:{arg}' is not a "
                     f"variant of it; use '{name}' (and --config.* overrides)")
  try:
    config = get_config(arg) if arg else get_config()
  except Exception as e:  # pylint: disable=broad-except
    raise InputError(f'config file {path}: get_config({arg!r}): {one_line(e)}' if arg
                     else f'config file {path}: get_config(): {type(e).__name__}: {one_line(e)}') from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise InputError(f'config file {path}: get_config() returned a {type(config).__name__}, '
                     'not an ml_collections.ConfigDict')
