"""The mutation check (`make mutate`): does each planted bug of tests/mutants.py fail its tests?

  python -m tests.mutate [--only SUBSTRING] [--jobs N]

The working tree is never touched: each job copies the repository's files (tracked and untracked,
not ignored) to a temporary folder and plants one mutant at a time there, restoring the file after
it. First the named tests run once unmutated (they must pass), then every mutant runs its own tests
(`pytest -x`): caught when one fails, survived when all pass. Compiled XLA programs are shared with
the checkout's test cache. Prints one line per mutant and a summary; exits non-zero when a mutant
that is not marked equivalent survives, an equivalent one is caught, or a mutant no longer applies.
"""

import argparse
import concurrent.futures
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.mutants import MUTANTS, Mutant  # noqa: E402

TIMEOUT_S = 600


def _copy_tree(dest: str) -> None:
  files = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard', '-z'], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout.split('\0')
  for rel in filter(None, files):
    if os.path.isfile(os.path.join(ROOT, rel)):
      os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
      shutil.copy2(os.path.join(ROOT, rel), os.path.join(dest, rel))


def _pytest(tree: str, tests, extra=()) -> tuple[int, float, str]:
  env = dict(os.environ, PYTHONDONTWRITEBYTECODE='1',
             JAX_COMPILATION_CACHE_DIR=os.path.join(ROOT, '.pytest_cache', 'xla'))
  start = time.monotonic()
  try:
    out = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider', *extra, *tests],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return -1, time.monotonic() - start, ''
  return out.returncode, time.monotonic() - start, out.stdout[-2000:]


def _apply(tree: str, m: Mutant) -> str:
  """Plant the mutant; returns the file's original text."""
  path = os.path.join(tree, m.path)
  with open(path) as f:
    text = f.read()
  if text.count(m.old) != 1:
    raise LookupError(f'{m.path} holds the text to mutate {text.count(m.old)} times, not once')
  with open(path, 'w') as f:
    f.write(text.replace(m.old, m.new))
  return text


def _run(trees: queue.Queue, m: Mutant) -> tuple[Mutant, str, float]:
  tree = trees.get()
  try:
    path = os.path.join(tree, m.path)
    try:
      original = _apply(tree, m)
    except LookupError as e:
      return m, f'no longer applies: {e}', 0.0
    try:
      rc, seconds, _ = _pytest(tree, m.tests)
    finally:
      with open(path, 'w') as f:
        f.write(original)
    result = {0: 'survived', 1: 'caught', -1: 'caught (timed out)'}.get(rc, f'error (pytest exit {rc})')
    return m, result, seconds
  finally:
    trees.put(tree)


def _verdict(m: Mutant, result: str) -> str:
  if m.equivalent:
    return 'ok' if result == 'survived' else 'NOT EQUIVALENT: a test catches it'
  return 'ok' if result.startswith('caught') else 'MISSED'


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', default='', help='run the mutants whose name contains this')
  parser.add_argument('--jobs', type=int, default=os.cpu_count() or 1)
  args = parser.parse_args(argv)
  mutants = [m for m in MUTANTS if args.only in m.name]
  if not mutants:
    print(f'no mutant name contains {args.only!r}', file=sys.stderr)
    return 2
  start = time.monotonic()
  with tempfile.TemporaryDirectory(prefix='mutate-') as tmp:
    trees = queue.Queue()
    for i in range(max(1, args.jobs)):
      _copy_tree(os.path.join(tmp, str(i)))
      trees.put(os.path.join(tmp, str(i)))
    tests = sorted({t for m in mutants for t in m.tests})
    rc, seconds, out = _pytest(os.path.join(tmp, '0'), tests, ('-n', str(max(1, args.jobs))) if args.jobs > 1 else ())
    print(f'unmutated: {len(tests)} test ids, pytest exit {rc} in {seconds:.0f} s', flush=True)
    if rc != 0:
      print(out, file=sys.stderr)
      print('the tests fail without a mutant: fix them first', file=sys.stderr)
      return 1
    bad = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
      for m, result, seconds in pool.map(lambda m: _run(trees, m), mutants):
        verdict = _verdict(m, result)
        bad += verdict != 'ok'
        note = f' [equivalent: {m.equivalent}]' if m.equivalent else ''
        print(f'{verdict:>6} | {result:<20} | {seconds:5.0f} s | {m.path} | {m.name}{note}', flush=True)
  caught = sum(1 for m in mutants if not m.equivalent)
  print(f'{len(mutants)} mutants ({caught} to catch, {len(mutants) - caught} equivalent), {bad} not as expected, '
        f'{(time.monotonic() - start) / 60:.1f} min', flush=True)
  return 1 if bad else 0


if __name__ == '__main__':
  sys.exit(main())
