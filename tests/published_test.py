"""docs/results.md's sections that keep their data: each table regenerates from its file in docs/data/."""

import glob
import os
import re

import pytest

from experiments import report as report_cli
from mtpd_jax.harness import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = sorted(glob.glob(os.path.join(ROOT, 'docs', 'data', '*.json')))
# The sections rerun to keep their data (the real-model recipe; the seeded mtp_vs_mtpd sweep joins
# when its rerun lands); any other file in docs/data/ is checked too.
REQUIRED = ('mtp_vs_mtpd-s3.json', 'smollm2_mtpd-cpu.json')


def _sections() -> list[str]:
  with open(os.path.join(ROOT, 'docs', 'results.md'), encoding='utf-8') as f:
    return re.split(r'\n(?=## )', f.read())


def _tables(md: str) -> list[str]:
  """Every markdown table of `md`: runs of consecutive lines that start with '|'."""
  return [t for t in re.findall(r'(?:^\|.*\n?)+', md, flags=re.M) if t.strip()]


def test_the_rerun_sections_keep_their_data():
  assert set(REQUIRED) <= {os.path.basename(p) for p in DATA}


@pytest.mark.parametrize('path', DATA, ids=os.path.basename)
def test_a_published_section_is_its_data_file_regenerated(path):
  tables = _tables(report.markdown(report_cli.load(path)))
  assert len(tables) >= 2
  holding = [s for s in _sections() if all(t.strip() in s for t in tables)]
  missing = [t.splitlines()[0] for t in tables if not any(t.strip() in s for s in _sections())]
  assert holding, f'{os.path.basename(path)}: tables not found unedited in one section of docs/results.md: {missing}'
  assert f'docs/data/{os.path.basename(path)}' in holding[0], 'the section should name its data file'
