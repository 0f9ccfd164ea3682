"""The two layers (docs/design.md, "Two layers"): the core (mtpd_jax/*.py) imports only the
numerical stack and itself; the harness (mtpd_jax/harness/) imports the core, never the reverse;
no library module imports configs/, experiments/, benchmarks/ or tests/; and no import cycle,
counting imports inside functions (they hide a cycle, they do not break it)."""

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE_THIRD_PARTY = {'jax', 'jaxlib', 'flax', 'optax', 'orbax', 'grain', 'numpy', 'ml_dtypes', 'tqdm'}
OUTSIDE_LIBRARY = {'configs', 'experiments', 'benchmarks', 'tests'}


def library_modules() -> dict[str, str]:
  """Dotted name -> path of every module of the mtpd_jax package."""
  out = {}
  for folder, _, files in os.walk(os.path.join(ROOT, 'mtpd_jax')):
    for name in files:
      if name.endswith('.py'):
        rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, '.')
        out[rel.removesuffix('.__init__')] = os.path.join(folder, name)
  return out


def imports_of(path: str, modules) -> set[str]:
  """Every module `path` imports, anywhere in the file; `from pkg import name` counts as pkg.name
  when that is a module of the package."""
  found = set()
  for node in ast.walk(ast.parse(open(path, encoding='utf-8').read())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      found.add(node.module)
      found.update(f'{node.module}.{a.name}' for a in node.names if f'{node.module}.{a.name}' in modules)
  return found


def graph() -> dict[str, set[str]]:
  modules = library_modules()
  return {name: imports_of(path, modules) for name, path in modules.items()}


def is_harness(name: str) -> bool:
  return name == 'mtpd_jax.harness' or name.startswith('mtpd_jax.harness.')


def test_the_walk_sees_every_module_and_imports_inside_functions(tmp_path):
  g = graph()
  assert {'mtpd_jax.train', 'mtpd_jax.losses', 'mtpd_jax.harness.recipe', 'mtpd_jax.harness.training'} <= set(g)
  assert 'mtpd_jax.train' in g['mtpd_jax.harness.training']
  path = tmp_path / 'm.py'
  path.write_text('import os\ndef f():\n  from mtpd_jax.harness import recipe\n  from configs import base\n')
  assert imports_of(str(path), {'mtpd_jax.harness.recipe'}) == {
      'os', 'mtpd_jax.harness', 'mtpd_jax.harness.recipe', 'configs'}


def test_the_core_imports_neither_the_harness_nor_anything_outside_the_numerical_stack():
  bad = []
  for name, imported in graph().items():
    if is_harness(name):
      continue
    for module in imported:
      top = module.split('.')[0]
      if is_harness(module) or (top != 'mtpd_jax' and top not in CORE_THIRD_PARTY
                                and top not in sys.stdlib_module_names):
        bad.append(f'{name} imports {module}')
  assert not bad, bad


def test_no_library_module_imports_configs_experiments_benchmarks_or_tests():
  bad = [f'{name} imports {m}' for name, imported in graph().items() for m in imported
         if m.split('.')[0] in OUTSIDE_LIBRARY]
  assert not bad, bad


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
  """One import cycle among the graph's own nodes (as a path that returns to its start), or None."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node):
    state[node] = 1
    path.append(node)
    for nxt in sorted(g[node] & set(g)):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    state[node] = 2
    path.pop()
    return None
  for node in sorted(g):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_find_cycle_finds_a_lazy_cycle_and_passes_a_tree():
  assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
  assert find_cycle({'a': {'b', 'c'}, 'b': {'c'}, 'c': {'numpy'}}) is None


@pytest.mark.parametrize('layer', ['core', 'all'])
def test_no_import_cycle(layer):
  g = graph()
  # Packages import nothing but their __init__; a module importing its own package is not a cycle.
  g = {name: {m for m in imported if m not in ('mtpd_jax', 'mtpd_jax.harness')} for name, imported in g.items()}
  if layer == 'core':
    g = {name: imported for name, imported in g.items() if not is_harness(name)}
  assert find_cycle(g) is None, find_cycle(g)
