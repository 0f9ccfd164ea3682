"""The train benchmarks run end to end in a quick mode, so they cannot rot, and report sane values."""

import json
import math

import pytest

from benchmarks import train_efficiency, train_memory, train_overhead


def _read(path):
  with open(path) as f:
    return json.load(f)


@pytest.mark.slow
def test_train_overhead_quick(tmp_path):
  train_overhead.main(train_overhead.parse_args(
      ['--configs=tiny', '--heads=1', '--reps=1', '--selections=threshold,top_k', f'--results_dir={tmp_path}']))
  r = _read(tmp_path / 'train_overhead.json')
  for key in ('tiny/k1/mtpd_over_mtp', 'tiny/k1/mtpd_top_k_over_mtp', 'tiny/k1/fused/mtpd_over_mtp'):
    assert 0.2 < r[key] < 20, (key, r[key])
  assert r['meta']['command'] and r['meta']['date'].startswith('20')


def test_train_memory_quick(tmp_path):
  train_memory.main(train_memory.parse_args(
      ['--config=tiny', '--batch_size=8', '--seq_len=64', '--fused_chunk_rows=64', f'--results_dir={tmp_path}']))
  r = _read(tmp_path / 'train_memory.json')
  # Four extra heads (each a block, a projection and a vocabulary projection) cost memory; the fused
  # loss never holds [K+1, B, T, V] logits, so its K=4 step needs less than the logits path.
  assert r['mem_k4_over_k0'] > 1.0
  assert r['bytes']['k4_fused']['temp'] < r['bytes']['k4']['temp']


def test_train_efficiency_quick(tmp_path):
  train_efficiency.main(train_efficiency.parse_args(
      ['--config=tiny', '--batch_size=8', '--seq_len=64', '--reps=1', '--matmul_n=256',
       '--fused_chunk_rows=64', f'--results_dir={tmp_path}']))
  r = _read(tmp_path / 'train_efficiency.json')
  assert r['model_flops'] == train_efficiency.model_flops(
      train_efficiency.common.get_config('tiny', num_heads=4, batch_size=8, seq_len=64))
  assert r['flops_fraction'] == r['fused/flops_fraction']
  for key in ('logits/flops_fraction', 'fused/flops_fraction'):
    assert 0 < r[key] and math.isfinite(r[key])
