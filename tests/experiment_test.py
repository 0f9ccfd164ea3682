"""The experiment pipeline end to end: embedded data, cached base model, one variant, decoding, report."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quick_sweep_point_trains_evaluates_and_reports(tmp_path):
  env = {**os.environ, 'JAX_NUM_CPU_DEVICES': '1', 'MTPD_JAX_CACHE': str(tmp_path / 'cache'), 'PYTHONPATH': ROOT}
  workdir = tmp_path / 'runs' / 'ablation_topn'
  cmd = [sys.executable, '-m', 'experiments.run', '--config=ablation_topn:quick', '--sweep_index=2',
         f'--workdir={workdir}']
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  run_dir = workdir / '2'
  with open(run_dir / 'eval.json') as f:
    ev = json.load(f)
  assert set(ev['prompt_sets']) == {'chat', 'code', 'math'}
  for result in ev['prompt_sets'].values():
    assert result['lossless'] is True
    assert 0.0 <= result['ar'][0] <= 1.0 and result['tokens_per_forward'] >= 1.0
  # The variant continued from the cached base model, which a rerun reuses without training again.
  summary = json.loads((run_dir / 'summary.json').read_text())
  assert summary['model_dir'] == str(run_dir)
  assert len(os.listdir(tmp_path / 'runs' / '_base')) == 1
  report = (tmp_path / 'results' / 'ablation_topn' / 'results.md').read_text()
  assert '| Top N = 66 (0.8% V) |' in report and '| MTP | – \\| – |' in report
  for name in ('results.json', 'acceptance.png', 'loss_curves.png'):
    assert (tmp_path / 'results' / 'ablation_topn' / name).stat().st_size > 0
  again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and 'finished earlier' in again.stdout, again.stderr[-2000:]
