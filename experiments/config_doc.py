"""The config reference: every field of configs/base.py with its default and its comment, as markdown.

The README carries this table between two markers; a test keeps it equal to what this module
generates, so the docs cannot drift from the code. Regenerate it with

  python -m experiments.config_doc --write README.md
"""

import os
import re
import sys

from flax import traverse_util

BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'base.py')
BEGIN, END = '<!-- config-reference:begin -->', '<!-- config-reference:end -->'
_ASSIGN = re.compile(r'^\s*c\.([\w.]+)\s*=\s*(.*?)\s*(?:#\s?(.*))?$')


def field_comments(path: str = BASE) -> dict[str, str]:
  """Dotted field name -> its comment: the comment lines just above it plus its trailing comment
  (and that comment's continuation lines, aligned under it). Sections (`= ConfigDict()`) included."""
  comments, above, last, last_col = {}, [], None, -1
  with open(path) as f:
    for line in f:
      stripped = line.strip()
      if stripped.startswith('#'):
        text = stripped[1:].strip()
        if last is not None and line.index('#') == last_col:
          comments[last] += ' ' + text
        else:
          above.append(text)
        continue
      m = _ASSIGN.match(line) if not stripped.startswith('c.model.update') else None
      if not m:
        above, last = [], None
        continue
      name, trailing = m.group(1), m.group(3)
      comments[name] = ' '.join(above + ([trailing.strip()] if trailing else []))
      above, last, last_col = [], name, (line.index('#') if trailing else -1)
  return comments


def _default(value) -> str:
  text = repr(tuple(value) if isinstance(value, list) else value)
  return '`' + text.replace('|', '\\|') + '`'


def reference_table(path: str = BASE) -> str:
  """Markdown: one row per field of base.get_config(), in the order base.py declares them."""
  from configs import base  # pylint: disable=import-outside-toplevel
  comments = field_comments(path)
  config = base.get_config()
  fields = set(traverse_util.flatten_dict(config.to_dict(), sep='.'))
  if missing := fields - set(comments):
    raise ValueError(f'{path} sets {sorted(missing)} in a way this reference cannot read')
  lines = ['| field | default | meaning |', '|---|---|---|']
  for name, comment in comments.items():
    value = config
    for key in name.split('.'):
      value = value[key]
    comment = comment.replace('|', '\\|')
    if hasattr(value, 'to_dict'):
      lines.append(f'| **{name}** | | {comment} |')
    else:
      lines.append(f'| `{name}` | {_default(value)} | {comment} |')
  return '\n'.join(lines)


def replace_block(text: str, table: str) -> str:
  """`text` with the part between the markers replaced by `table`."""
  start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
  return text[:start] + '\n' + table + '\n' + text[end:]


def main(argv: list[str]) -> int:
  if len(argv) == 3 and argv[1] == '--write':
    with open(argv[2]) as f:
      text = f.read()
    with open(argv[2], 'w') as f:
      f.write(replace_block(text, reference_table()))
    return 0
  print(reference_table())
  return 0


if __name__ == '__main__':
  from mtpd_jax.harness import cli
  cli.run(lambda: main(sys.argv))
