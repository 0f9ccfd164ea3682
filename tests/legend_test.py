"""Array names keep to the dimension legend of mtpd_jax/__init__.py: every axis in a name's suffix
is one of its letters or words (STYLE: "a suffix that needs the legend open to read has stopped helping")."""

import io
import os
import re
import tokenize

import mtpd_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ('mtpd_jax', 'experiments', 'benchmarks', 'configs', 'tests', 'notebooks')


def legend() -> tuple[set[str], set[str]]:
  """The legend's letters and words, read from the package docstring."""
  doc = mtpd_jax.__doc__
  letters_part = doc[doc.index('The letters'):doc.index('An axis that lives')]
  words_part = doc[doc.index('The words:'):]
  letters = set(re.findall(r'(?:^|\s{2,})([A-Z])  \S', letters_part, re.M))
  words = set()
  for names in re.findall(r'^  ([A-Z][a-z]+(?:, [A-Z][a-z]+)*)  ', words_part, re.M):
    words.update(names.split(', '))
  return letters, words


def suffix_pattern(axis: str) -> re.Pattern:
  """A name whose last part is axes joined by 'x' ('BxTxV', 'K1xBxTxV', 'Gx1xD', 'BxNodes')."""
  token = rf'(?:\d*(?:{axis})\d*|\d+)'
  return re.compile(rf'[a-z][a-z0-9_]*_((?=\w*[A-Z]){token}(?:x{token})*)')


def names_off_legend(source: str, letters: set[str], words: set[str]) -> set[str]:
  """The identifiers of `source` that look like shape-suffixed names but use an axis the legend lacks."""
  any_axis = suffix_pattern('[A-Z][a-z]*')
  legend_axis = suffix_pattern('|'.join(sorted(words, key=len, reverse=True) + sorted(letters)))
  off = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.NAME and any_axis.fullmatch(tok.string) and not legend_axis.fullmatch(tok.string):
      off.add(tok.string)
  return off


def test_the_legend_has_about_a_dozen_letters_and_reads_its_words():
  letters, words = legend()
  assert letters == set('BDEFGHJKNRSTUV')
  assert {'Nodes', 'Paths', 'Steps', 'Experts', 'In', 'Out'} <= words


def test_the_scan_flags_an_axis_outside_the_legend_and_passes_the_legend_own():
  letters, words = legend()
  source = ('logits_BxTxV = 1\nmtp_KxBxTxV = 1\nh_Parentsx1xD = 1\nnodes_BxNodes = 1\nempty_0xBxTxV = 1\n'
            'a_BxP = 1\nx_BxO = 1\nq_BxTxGxQxE = 1\ny_Bxnodes = 1\nTOKEN_IDS = 1\nprobs = 1\nw_Zs = 1\n')
  # 'Bxnodes' reads as one word the legend lacks: words are capitalised.
  assert names_off_legend(source, letters, words) == {'a_BxP', 'x_BxO', 'q_BxTxGxQxE', 'y_Bxnodes', 'w_Zs'}


def test_every_shape_suffix_in_the_repository_keeps_to_the_legend():
  letters, words = legend()
  off = {}
  for folder in FOLDERS:
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
      for name in files:
        if name.endswith('.py'):
          path = os.path.join(dirpath, name)
          with open(path) as f:
            found = names_off_legend(f.read(), letters, words)
          if found:
            off[os.path.relpath(path, ROOT)] = sorted(found)
  assert not off, f'names with axes outside the legend (mtpd_jax/__init__.py): {off}'
