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


@pytest.mark.slow
def test_train_memory_quick(tmp_path):
  train_memory.main(train_memory.parse_args(
      ['--config=tiny', '--batch_size=8', '--seq_len=64', '--fused_chunk_rows=64', f'--results_dir={tmp_path}']))
  r = _read(tmp_path / 'train_memory.json')
  # Four extra heads (each a block, a projection and a vocabulary projection) cost memory; the fused
  # loss never holds [K+1, B, T, V] logits, so its K=4 step needs less than the logits path.
  assert r['mem_k4_over_k0'] > 1.0
  assert r['bytes']['k4_fused']['temp'] < r['bytes']['k4']['temp']


@pytest.mark.slow
def test_train_efficiency_quick(tmp_path):
  train_efficiency.main(train_efficiency.parse_args(
      ['--config=tiny', '--batch_size=8', '--seq_len=64', '--reps=1', '--matmul_n=256',
       '--fused_chunk_rows=64', f'--results_dir={tmp_path}']))
  r = _read(tmp_path / 'train_efficiency.json')
  # By hand for tiny (V=256, D=64, 2 layers, H=4, G=2, E=16, F=192) with K=4, 8 x 64 tokens: a block's
  # matrices hold 3*4096 + 3*64*192 = 49,152 weights; per token 2 blocks + 4 heads (a block and a
  # 2D x D projection each) + 5 unembeddings = 409,600; 6 FLOPs per weight and token over 512 tokens,
  # plus attention 12*B*T^2*H*E per block (6 blocks) = 150,994,944.
  assert r['model_flops'] == 6 * 409_600 * 512 + 150_994_944
  assert r['flops_fraction'] == r['fused/flops_fraction']
  for key in ('logits/flops_fraction', 'fused/flops_fraction'):
    assert 0 < r[key] and math.isfinite(r[key])


@pytest.mark.slow
def test_decode_cost_quick(tmp_path):
  """The decoding cost benchmark on a tiny random model: every key, parts and bytes that add up."""
  from benchmarks import decode_cost  # pylint: disable=import-outside-toplevel
  decode_cost.main(decode_cost.parse_args(
      ['--model=tiny', '--batch_sizes=1', '--depths=1,4', '--draft_vocab=64', '--steps=4', '--repeats=1',
       '--trees=3,2', f'--results_dir={tmp_path}']))
  r = _read(tmp_path / 'decode_cost.json')
  for key in ('spec_over_plain_j1', 'spec_over_plain_j4', 'plain_over_bound', 'read_gb_per_s',
              'spec_over_plain_j1_standard', 'spec_over_plain_j4_standard'):
    assert math.isfinite(r[key]) and r[key] > 0, key
  assert r['read_gb_per_s_rounds'] == [r['read_gb_per_s']]  # --repeats=1: one round beside the plain step
  row = r['batches']['1']
  names = {'j0', 'j1', 'j4', 'j4_draft_vocab'}
  assert set(row) == names | {f'{n}_standard' for n in names} | {'chain2', 'tree3x2'}  # the training layout too
  for name, paths, nodes in (('chain2', 1, 3), ('tree3x2', 6, 10)):  # a tree's step, split into its phases
    phases = row[name]['phases_ms']
    assert (row[name]['paths'], row[name]['nodes']) == (paths, nodes)
    assert min(phases[k] for k in ('verify', 'accept', 'draft', 'step')) > 0
    assert phases['commit'] == pytest.approx(phases['step'] - phases['verify'] - phases['accept'] - phases['draft'])
  assert row['j0_standard']['over_plain'] == 1
  for name in names:
    x = row[name]
    assert x['bytes']['total'] == sum(v for k, v in x['bytes'].items() if k != 'total')
    assert x['parts_ms']['verify_trunk'] > 0 and x['parts_ms']['verify_logits'] > 0
  # A draft vocabulary of 64 of 256 ids reads a quarter of the draft unembedding.
  assert row['j4_draft_vocab']['bytes']['drafts'] < row['j4']['bytes']['drafts']
  assert row['j0']['bytes']['drafts'] == 0
