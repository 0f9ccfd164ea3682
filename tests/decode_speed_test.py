"""benchmarks/decode_speed.py runs end to end in a quick mode (tiny model; a fake GGUF llama) and reports sane values."""

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks import decode_speed, hf_generate, tiny_heads
from mtpd_jax.harness import cli, planner

QUICK = ['--num_prompts=2', '--max_new_tokens=8', '--repeats=1', '--timing_steps=4', '--timing_repeats=1']


def _check_run(r: dict, depth: int) -> None:
  """One evaluate_prompt_set result: lossless, acceptance rates in [0, 1], at least one token per forward."""
  assert r['lossless'] is True
  assert len(r['ar']) == len(r['car']) == depth
  rates = [x for x in r['ar'] + r['car'] if x is not None and not math.isnan(x)]  # nan (None in JSON): no chains
  assert rates and all(0.0 <= x <= 1.0 for x in rates), (r['ar'], r['car'])
  assert 1.0 <= r['tokens_per_forward'] <= depth + 1
  assert r['plain_tokens_per_s'] > 0 and r['spec_tokens_per_s'] > 0


@pytest.mark.slow
@pytest.mark.usefixtures('few_candidates')
def test_tiny_quick(tmp_path, monkeypatch):
  out = tmp_path / 'decode_speed.json'
  planned = []  # the options the planner is given: its candidates draft over their vocabulary
  plan = planner.plan
  monkeypatch.setattr(planner, 'plan', lambda model, prompts, opts, **kw: planned.append(opts) or plan(
      model, prompts, opts, **kw))
  results = decode_speed.main(decode_speed.parse_args(
      QUICK + ['--train_steps=20', '--num_mtp_heads=2', '--num_layers=2', '--depths=3', '--draft_min_prob=0,0.5',
               '--tree=2,1,1', '--speculation=auto', '--draft_source=heads,context,both', '--ngram=2',
               '--draft_vocab=48', f'--out={out}']))
  assert [len(o.draft.vocab) for o in planned] == [48] and planned[0].draft.ngram == 2
  saved = json.loads(out.read_text())
  assert set(saved) >= {'model', 'num_mtp_heads', 'train_s', 'args', 'model_config', 'sets', 'meta', 'adaptive_effect',
                        'tree_effect', 'auto_effect'}
  assert saved['meta']['command'] and saved['meta']['date'].startswith('20') and saved['complete'] is True
  assert list(saved['sets']) == ['synthetic'] and list(saved['sets']['synthetic']) == ['b1']
  for key, p in (('depth3_mp0', 0.0), ('depth3_mp0.5', 0.5)):  # depth 3 loops head 1 again
    r = saved['sets']['synthetic']['b1'][key]
    _check_run(r, 3)
    assert r['new_tokens'] == 2 * 8 and r['draft_min_prob'] == p  # no stop tokens in the tiny mode
    assert results['sets']['synthetic']['b1'][key]['lossless'] is True
  tree = saved['sets']['synthetic']['b1']['depth3_mp0_tree']
  assert tree['tree'] == [2, 1, 1] and tree['lossless'] is True
  assert saved['tree_effect']['synthetic/b1/depth3_mp0']['accept_len'] == tree['accept_len']
  assert saved['sets']['synthetic']['b1']['depth3_mp0.5_tree']['lossless'] is True  # adaptive depth on a tree
  for key, source in (('depth3_mp0_context', 'context'), ('depth3_mp0_both', 'both'), ('depth3_mp0.5_both', 'both')):
    r = saved['sets']['synthetic']['b1'][key]
    _check_run(r, 3)
    assert r['draft_source'] == source
  assert 'depth3_mp0.5_context' not in saved['sets']['synthetic']['b1']  # no head probabilities to cut at
  auto, fixed = saved['auto_effect']['synthetic/b1'], saved['sets']['synthetic']['b1']
  assert auto['setting'] in ('plain', 'chain1', 'context2') and auto['lossless'] is True
  assert auto['speedup'] == fixed['auto']['speedup_measured'] and auto['best_fixed'] != 'auto'
  assert auto['best_fixed_speedup'] == max(r['speedup_measured'] for k, r in fixed.items() if k != 'auto')
  effect = saved['adaptive_effect']['synthetic/b1/depth3']['0.5']
  adaptive = saved['sets']['synthetic']['b1']['depth3_mp0.5']
  assert effect['tokens_per_forward'] == adaptive['tokens_per_forward'] and effect['lossless'] is True
  assert effect['spec_tokens_per_s_over_full'] == pytest.approx(
      adaptive['spec_tokens_per_s'] / saved['sets']['synthetic']['b1']['depth3_mp0']['spec_tokens_per_s'])


def test_each_fixed_setting_is_decoded_once_and_named_by_what_varies():
  """No --tree: one chain per depth and source (a tree of () once doubled every setting); a list of
  thresholds names each; context chains take no threshold, so none is made at 0.5."""
  args = decode_speed.parse_args(['--draft_min_prob=0,0.5', '--draft_source=heads,context,both', '--ngram=2'])
  settings, chains, trees = decode_speed.fixed_settings(args, [2, 3], {0: None}, (7,))
  assert list(settings) == ['depth2_mp0', 'depth2_mp0_context', 'depth2_mp0_both', 'depth2_mp0.5',
                            'depth2_mp0.5_both', 'depth3_mp0', 'depth3_mp0_context', 'depth3_mp0_both',
                            'depth3_mp0.5', 'depth3_mp0.5_both']
  assert chains == {'depth2': {0.0: 'depth2_mp0', 0.5: 'depth2_mp0.5'}, 'depth3': {0.0: 'depth3_mp0', 0.5: 'depth3_mp0.5'}}
  assert trees == {}
  plan = settings['depth3_mp0.5_both'].draft
  assert (plan.depth, plan.min_prob, plan.source, plan.ngram) == (3, 0.5, 'both', 2)
  assert settings['depth2_mp0'].stop_tokens == (7,)
  _, _, trees = decode_speed.fixed_settings(decode_speed.parse_args(['--tree=2,1']), [2, 3], {0: None}, ())
  assert trees == {'depth2': 'depth2_tree'}


def test_parse_args_fills_per_model_defaults():
  tiny = decode_speed.parse_args([])
  assert (tiny.train_steps, tiny.depths, tiny.batch_sizes, tiny.out.endswith('results/decode_speed.json')) == (
      300, [4, 8], [1], True)
  real = decode_speed.parse_args(['--model=smollm2', '--train_steps=7'])
  assert (real.train_steps, real.train_batch, real.train_seq, real.depths, real.batch_sizes) == (7, 4, 128, [], [1, 8])
  assert real.out.endswith('results/decode_speed_smollm2.json')
  with pytest.raises(cli.InputError, match='--workdir needs a GGUF'):
    decode_speed.parse_args(['--workdir=somewhere'])  # a workdir needs a GGUF model
  assert decode_speed.parse_args(['--draft_min_prob=0,0.25']).draft_min_prob == [0.0, 0.25]
  for bad in ('0,1.5', 'x', '0.5,0.5'):
    with pytest.raises(cli.InputError, match='--draft_min_prob'):
      decode_speed.parse_args([f'--draft_min_prob={bad}'])
  for flag, bad in (('depths', 'abc'), ('depths', '0'), ('batch_sizes', '1,1'), ('draft_vocab', '-1'),
                    ('speculation', 'fast'), ('calibration_prompts', '0'), ('draft_source', 'lookup'),
                    ('draft_source', 'heads,heads'), ('ngram', '0')):
    with pytest.raises(cli.InputError, match=f'^--{flag}={bad} must be'):  # the flag is named, not int()'s words
      decode_speed.parse_args([f'--{flag}={bad}'])
  assert decode_speed.parse_args(['--tree=3,2,1,1']).tree == (3, 2, 1, 1)
  for bad in ('3,x', '2,0'):
    with pytest.raises(cli.InputError, match='--tree'):
      decode_speed.parse_args([f'--tree={bad}'])


@pytest.fixture(scope='module')
def fake_gguf(tmp_path_factory):
  pytest.importorskip('gguf')
  from tests.gguf_test import write_fake_gguf  # pylint: disable=import-outside-toplevel
  path = tmp_path_factory.mktemp('gguf') / 'tiny.gguf'
  write_fake_gguf(path)
  return str(path)


def test_heads_only_training_moves_the_heads_and_leaves_the_trunk_bitwise(fake_gguf):
  from mtpd_jax.harness import gguf_llama  # pylint: disable=import-outside-toplevel
  model = gguf_llama.load_model(fake_gguf, num_mtp_heads=2)
  before = {gguf_llama.param_key(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}
  rows = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (8, 17))
  xent_SxK = tiny_heads.train_mtp(model, rows, steps=3, batch_size=4, lr=1e-2, trainable=tiny_heads.HEADS,
                                    main_head=False)
  assert xent_SxK.shape == (3, 2) and np.all(np.isfinite(xent_SxK))
  after = {gguf_llama.param_key(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}
  for key, x in after.items():
    if key[0] == 'mtp_heads':
      assert not np.array_equal(x, before[key]), key
    else:
      np.testing.assert_array_equal(x, before[key], err_msg=str(key))


@pytest.mark.slow
def test_gguf_quick_with_hf_side_by_side(fake_gguf, tmp_path):
  hf = hf_generate.available()
  out = tmp_path / 'decode_speed_fake.json'
  decode_speed.main(decode_speed.parse_args(
      QUICK + [f'--model={fake_gguf}', f'--cache_dir={tmp_path / "cache"}', '--train_chars=20000',
               '--train_steps=3', '--train_batch=2', '--train_seq=16', '--max_prompt_tokens=48',
               '--num_mtp_heads=2', '--batch_sizes=1,2', '--prompt_sets=chat,code', '--draft_vocab=64,0',
               '--hf' if hf else '--nohf', f'--out={out}']))
  saved = json.loads(out.read_text())
  assert saved['num_mtp_heads'] == 2 and saved['file'] == 'tiny.gguf' and saved['train_tokens'] == 3 * 2 * 17
  assert len(saved['train_xent_first']) == len(saved['train_xent_last']) == 2
  for name in ('chat', 'code'):
    for b in ('b1', 'b2'):
      for dv in (64, 0):  # depth K by default; drafts from the 64 most frequent tokens, then from all
        r = saved['sets'][name][b][f'depth2_dv{dv}']
        _check_run(r, 2)
        assert r['prompts'] == 2 and 0 < r['new_tokens'] <= 2 * 8 and r['draft_vocab'] == dv
      effect = saved['draft_vocab_effect'][f'{name}/{b}/depth2']['64']
      assert effect['ar1_minus_full'] == pytest.approx(
          saved['sets'][name][b]['depth2_dv64']['ar'][0] - saved['sets'][name][b]['depth2_dv0']['ar'][0])
  if hf:
    assert saved['hf_prompts'] == 4 and 0 <= saved['hf_greedy_equal'] <= 4
    assert 0 <= saved['hf_lookup_equal_hf_plain'] <= 4
    for key in ('hf_plain_tokens_per_s', 'hf_lookup_tokens_per_s', 'ours_plain_tokens_per_s', 'ours_spec_tokens_per_s',
                'ours_plain_over_hf_plain', 'ours_spec_over_hf_plain', 'ours_spec_over_hf_lookup'):
      assert saved[key] > 0 and math.isfinite(saved[key]), key
    assert saved['ours_new_tokens'] == sum(saved['sets'][n]['b1']['depth2_dv64']['new_tokens'] for n in ('chat', 'code'))


@pytest.mark.slow
def test_gguf_workdir_brings_its_own_trained_heads(fake_gguf, tmp_path):
  from mtpd_jax.harness import training
  from tests.conftest import small_config  # pylint: disable=import-outside-toplevel
  from tests.gguf_test import FAKE  # pylint: disable=import-outside-toplevel
  c = small_config(num_mtp_heads=3, steps=2)
  c.model.update({**FAKE, 'max_seq_len': 32})
  c.distill.top_n, c.eval.enabled = 16, False
  c.train.init_from, c.train.trainable = fake_gguf, 'mtp_heads'
  c.mesh.shape = (1, 1, 1)
  training.train_and_evaluate(c, str(tmp_path / 'run'), progress=False)
  saved = decode_speed.main(decode_speed.parse_args(
      QUICK + [f'--model={fake_gguf}', f'--workdir={tmp_path / "run"}', '--max_prompt_tokens=32',
               '--batch_sizes=1', '--prompt_sets=math', '--nohf', f'--out={tmp_path / "out.json"}']))
  assert saved['num_mtp_heads'] == 3 and saved['workdir'] == str(tmp_path / 'run')  # not --num_mtp_heads' default 4
  assert 'train_s' not in saved  # nothing was trained here
  _check_run(saved['sets']['math']['b1']['depth3'], 3)
