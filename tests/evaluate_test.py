"""Evaluation: one prompt set end to end, held-out metrics, report files."""

import dataclasses
import gzip
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from mtpd_jax import decode, losses, metrics
from mtpd_jax.harness import evaluate
from mtpd_jax.model import ModelConfig, MTPTransformer

CFG = ModelConfig(vocab_size=32, dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                  mlp_dim=64, num_mtp_heads=2)


def _write_jsonl(path, records, compress=False):
  with (gzip.open if compress else open)(path, 'wt') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)


@pytest.mark.slow
def test_evaluate_prompt_set_and_write_report(tmp_path):
  model = MTPTransformer(CFG, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 32, n) for n in (5, 11, 3)]  # two batches of 2, the last one padded
  r = evaluate.evaluate_prompt_set(model, prompts, decode.options(8, draft_depth=3), batch_size=2,
                                   pad_multiple=16, repeats=1, timing_steps=4, latency_prompts=2)
  assert r['lossless'] and r['new_tokens'] == 3 * 8 and r['prompts'] == 3
  assert r['latency_prompts'] == 2 and r['speedup_batch1'] == pytest.approx(
      r['spec_tokens_per_s_batch1'] / r['plain_tokens_per_s_batch1']) and r['speedup_batch1'] > 0
  assert len(r['ar']) == len(r['car']) == len(r['tf_ar']) == 3
  ar = np.nan_to_num(r['ar'])  # a depth no step reached has AR nan and CAR 0
  np.testing.assert_allclose(r['car'], np.cumprod(ar), atol=1e-12)
  assert r['tokens_per_forward'] == pytest.approx(1 + r['accept_len'])
  assert r['speedup_analytic'] == pytest.approx(r['tokens_per_forward'] / r['verify_cost_ratio'])
  assert r['speedup_measured'] == pytest.approx(r['spec_tokens_per_s'] / r['plain_tokens_per_s'])
  # One timing round: its speedup is the measured one (each round's, for the report's noise marks).
  assert r['speedup_rounds'] == [pytest.approx(r['speedup_measured'])]
  assert r['speedup_batch1_rounds'] == [pytest.approx(r['speedup_batch1'])]

  results = {'chat': r, 'code': {**r, 'ar': r['ar'][:2], 'car': r['car'][:2]}}
  evaluate.write_report(results, str(tmp_path), heldout={'loss': 1.5, 'accuracy': 0.25, 'tokens': 10})
  saved = json.loads((tmp_path / 'eval.json').read_text())
  assert saved['prompt_sets']['chat']['new_tokens'] == 24 and saved['heldout']['accuracy'] == 0.25
  md = (tmp_path / 'eval.md').read_text().splitlines()
  assert '| H | chat | code |' in md
  row2 = next(line for line in md if line.startswith('| 2 |'))
  ar2 = '–' if np.isnan(r['ar'][1]) else f"{100 * r['ar'][1]:.2f}"  # depth 2 may never be reached
  cell = f"{100 * r['car'][1]:.2f} / {ar2}"
  assert row2 == f'| 2 | {cell} | {cell} |'
  assert next(line for line in md if line.startswith('| 3 |')).endswith('|  |')  # 'code' has 2 heads only
  assert (tmp_path / 'eval.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  heldout = {'loss': 1.5, 'accuracy': 0.25, 'tokens': 10}
  evaluate.write_report({}, str(tmp_path / 'plain_lm'), heldout=heldout)  # a model without heads
  assert 'accuracy 25.00%' in (tmp_path / 'plain_lm' / 'eval.md').read_text()


def test_timed_decode_gives_each_prompt_its_own_generation_and_compiles_a_shape_once():
  model = MTPTransformer(CFG, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(3)
  prompts = [rng.integers(1, 32, n) for n in (5, 70, 3, 7, 2)]  # batches of 2: padded to 64, 64, 128
  kwargs = {'plain': dict(max_new_tokens=6), 'spec': dict(max_new_tokens=6, draft_depth=3)}
  settings = {name: decode.options(**kw) for name, kw in kwargs.items()}
  compiled = set()
  rounds = {}
  runs = evaluate.timed_decode(model, prompts, settings, batch_size=2, repeats=2, compiled=compiled, rounds=rounds)
  assert compiled == {(name, (2, p)) for name in settings for p in (64, 128)}
  for name, kw in kwargs.items():
    gen, seconds = runs[name]
    assert seconds > 0 and len(gen.tokens) == len(prompts)
    assert len(rounds[name]) == 2 and min(rounds[name]) >= seconds  # each round's sum, the best per batch's
    for p, tokens, accepts in zip(prompts, gen.tokens, gen.accept_lengths):  # in the prompts' order
      alone = decode.generate(model, [p], pad_multiple=64 * (1 + (len(p) > 64)), **kw)
      np.testing.assert_array_equal(tokens, alone.tokens[0])
      np.testing.assert_array_equal(accepts, alone.accept_lengths[0])
  assert all(np.array_equal(a, b) for a, b in zip(runs['plain'][0].tokens, runs['spec'][0].tokens))
  # Another prompt set under the same settings compiles nothing new.
  evaluate.timed_decode(model, prompts[:2], settings, batch_size=2, repeats=1, compiled=compiled)
  assert len(compiled) == 4


def test_teacher_forced_in_batches_equals_the_whole_set_at_once():
  model = MTPTransformer(CFG, rngs=nnx.Rngs(2))
  rng = np.random.default_rng(2)
  prompts = [rng.integers(1, 32, n) for n in (5, 11, 3, 7, 2)]
  continuations = [rng.integers(1, 32, n) for n in (6, 4, 9, 5, 8)]
  tokens_BxT, _ = decode.pad_prompts([np.concatenate(x) for x in zip(prompts, continuations)], 64)
  logits_BxTxV, draft_logits_JxBxTxV = decode.looped_forward(model, tokens_BxT, 3)
  valid_BxT = np.zeros(tokens_BxT.shape, bool)
  for b, (p, c) in enumerate(zip(prompts, continuations)):
    valid_BxT[b, len(p) - 1:len(p) + len(c)] = True
  want = metrics.teacher_forced_stats(np.argmax(logits_BxTxV, -1), np.argmax(draft_logits_JxBxTxV, -1), valid_BxT)
  assert want['steps'] == sum(len(c) - 2 for c in continuations)  # a chain needs 4 of len(c) + 1 valid
  # The main head on the prompts' own next tokens, as a held-out batch of the prompts counts it.
  t = max(map(len, prompts)) - 1
  prompt_batch = {k: np.zeros((len(prompts), t), np.int32) for k in ('inputs', 'targets', 'segment_ids')}
  for b, p in enumerate(prompts):
    prompt_batch['inputs'][b, :len(p) - 1], prompt_batch['targets'][b, :len(p) - 1] = p[:-1], p[1:]
    prompt_batch['segment_ids'][b, :len(p) - 1] = 1
  main = evaluate.heldout_metrics(model, [{**prompt_batch, 'target_segment_ids': prompt_batch['segment_ids']}])
  assert main['tokens'] == sum(len(p) - 1 for p in prompts)
  for batch_size in (1, 2, 8):  # 5 rows: padded last batches, and one batch larger than the set
    got = evaluate.teacher_forced(model, prompts, continuations, 3, batch_size)
    assert got.keys() == want.keys() | {'main_loss', 'main_accuracy'}
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=f'{key} at batch size {batch_size}')
    assert got['main_loss'] == pytest.approx(main['loss'], rel=1e-5)
    assert got['main_accuracy'] == pytest.approx(main['accuracy'])


def test_heldout_metrics_matches_a_direct_computation():
  model = MTPTransformer(CFG, rngs=nnx.Rngs(1))
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, 32, (2, 9)).astype(np.int32)
  seg = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 2], [1] * 9], np.int32)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'segment_ids': seg[:, :-1],
           'target_segment_ids': seg[:, 1:]}
  got = evaluate.heldout_metrics(model, [batch, batch])
  logits = jax.jit(lambda x, s: model(x, s).logits_BxTxV)(batch['inputs'], batch['segment_ids'])
  mask = np.asarray(losses.target_mask(batch['segment_ids'], batch['target_segment_ids'], 0))
  assert mask.sum() == 15  # the target that opens document 2 is left out
  xent = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets']))
  assert got['loss'] == pytest.approx(xent[mask].mean(), rel=1e-5)
  assert got['accuracy'] == pytest.approx((np.argmax(logits, -1) == batch['targets'])[mask].mean())
  assert got['tokens'] == 30


def test_the_trunk_signature_is_the_shape_without_the_heads():
  sign = evaluate.trunk_signature
  assert sign(CFG) == sign(dataclasses.replace(CFG, num_mtp_heads=CFG.num_mtp_heads + 3))
  assert sign(CFG) != sign(dataclasses.replace(CFG, num_layers=CFG.num_layers + 1))
  assert sign(CFG) != sign(dataclasses.replace(CFG, dtype='bfloat16'))


def test_generation_and_the_timed_step_loops_compile_one_step_program_per_setting():
  """An evaluation decodes each setting (`timed_decode`) and times its steps (`step_seconds`) with
  the same two programs, `jit_prefill` and `jit_steps`: the step loop compiles once, not twice."""
  model = MTPTransformer(CFG, rngs=nnx.Rngs(4))
  prompts = [np.arange(1, 6), np.arange(2, 9)]
  settings = {'plain': decode.options(max_new_tokens=5), 'spec': decode.options(max_new_tokens=5, draft_depth=2)}
  before = decode.jit_steps._cache_size(), decode.jit_prefill._cache_size()
  evaluate.timed_decode(model, prompts, settings, batch_size=2, repeats=1)
  evaluate.step_seconds(model, prompts, settings, num_steps=4, repeats=1)
  assert (decode.jit_steps._cache_size(), decode.jit_prefill._cache_size()) == (before[0] + 2, before[1] + 2)
