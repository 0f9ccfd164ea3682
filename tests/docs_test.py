"""The docs match the code: the README's config reference is generated from configs/base.py."""

import os

from flax import traverse_util

from configs import base
from experiments import config_doc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_field_comments_join_lines_above_trailing_comment_and_aligned_continuations(tmp_path):
  path = tmp_path / 'cfg.py'
  path.write_text('def get_config():\n'
                  '  c.a = 1\n'
                  '  c.sec = ml_collections.ConfigDict()  # a section\n'
                  '  # above one\n'
                  '  # above two\n'
                  '  c.sec.b = 2  # trailing\n'
                  '               # continued\n'
                  '  # not for c.sec.b: above c.sec.c\n'
                  '  c.sec.c = 3\n'
                  '  return c\n')
  assert config_doc.field_comments(str(path)) == {
      'a': '', 'sec': 'a section', 'sec.b': 'above one above two trailing continued',
      'sec.c': 'not for c.sec.b: above c.sec.c'}


def test_every_config_field_is_documented():
  comments = config_doc.field_comments()
  assert set(comments) >= set(traverse_util.flatten_dict(base.get_config().to_dict(), sep='.'))
  undocumented = [name for name, text in comments.items() if not text]
  assert not undocumented, f'configs/base.py: give these fields a comment: {undocumented}'


def test_readme_config_reference_is_current():
  with open(os.path.join(ROOT, 'README.md')) as f:
    readme = f.read()
  assert config_doc.replace_block(readme, config_doc.reference_table()) == readme, (
      'README.md config reference is stale: python -m experiments.config_doc --write README.md')
