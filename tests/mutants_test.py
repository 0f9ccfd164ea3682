"""`make mutate` stays runnable: a rename in the core that moves a mutant's text shows here, in
the fast subset, and not first in the mutation check."""

import os

import pytest

from tests.mutants import MUTANTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('mutant', MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_once_and_names_tests_that_exist(mutant):
  with open(os.path.join(ROOT, mutant.path)) as f:
    assert f.read().count(mutant.old) == 1, f'{mutant.path}: the text to mutate must occur once'
  for node in mutant.tests:
    path, name = node.split('::')
    with open(os.path.join(ROOT, path)) as f:
      assert f'def {name.split("[")[0]}(' in f.read(), node
