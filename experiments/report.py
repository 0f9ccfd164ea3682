"""Regenerate a published report's tables from its data file alone (no runs, no checkpoints).

  python -m experiments.report docs/data/NAME.json [--out_dir=DIR]

Prints the report (results.md) that the sweep wrote from the same data; with --out_dir it also
writes results.md and acceptance.png there. The data files in docs/data/ are the data.json that
each published sweep wrote next to its results.md (mtpd_jax/harness/report.py, `section_data`).
"""

import json
import os

from absl import app, flags

_OUT_DIR = flags.DEFINE_string('out_dir', None, 'also write results.md and acceptance.png here')


def load(path: str) -> dict:
  """A report's data file, checked enough that a wrong file is named in one line."""
  from mtpd_jax.harness import report
  if not os.path.isfile(path):
    raise FileNotFoundError(f'data file {path} does not exist')
  try:
    with open(path, encoding='utf-8') as f:
      data = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'data file {path} is not JSON: {e}') from None
  if not isinstance(data, dict) or data.get('format') != report.DATA_FORMAT or 'rows' not in data:
    raise ValueError(f'data file {path} is not a report data file (format {report.DATA_FORMAT}), as a '
                     'sweep writes next to its results.md')
  return data


def main(argv):
  if len(argv) != 2:
    raise ValueError('give one data file: python -m experiments.report docs/data/NAME.json')
  from mtpd_jax.harness import report
  data = load(argv[1])
  md = report.markdown(data)
  print(md, flush=True)
  if _OUT_DIR.value:
    from mtpd_jax import runtime
    rows = [(r['label'], r['runs']) for r in data['rows']]
    runtime.write_atomically(os.path.join(_OUT_DIR.value, 'results.md'), md)
    if report.depth_of(rows):
      report.plot_acceptance(rows, os.path.join(_OUT_DIR.value, 'acceptance.png'))


def run():
  from mtpd_jax.harness import cli
  cli.run(lambda: app.run(main, flags_parser=cli.parse_absl_flags))


if __name__ == '__main__':
  run()
