"""Golden acceptance: a fixed small MTP-D run whose per-head acceptance is pinned.

The `tiny` config (2 heads, 150 steps on the synthetic stream, seed 0) is trained and decoded on
the starts of held-out records. Its teacher-forced and online (speculative greedy) AR per head are
pinned to the values this test recorded when it was written, within `TOL` (absolute): on another
CPU, XLA's float rounding may flip an argmax or two, but a change that silently lowers acceptance
(a loss term dropped, a head fed the wrong token, a verify rule off by one) moves them by far more.
If a deliberate change moves them, rerun with GOLDEN_PRINT=1 and update the numbers, saying why.
"""

import os

import numpy as np
import pytest

from configs import tiny
from mtpd_jax import decode, metrics
from mtpd_jax.harness import evaluate, recipe, training

TOL = 0.04
# Recorded on 2026-12-03 (JAX 0.10.2, XLA:CPU), the values printed by GOLDEN_PRINT=1.
GOLDEN = {'online_ar': [0.3462, 0.7888], 'tf_ar': [0.5213, 0.875]}


def _config():
  c = tiny.get_config()
  c.model.num_mtp_heads = 2
  c.train.steps = 150
  c.data.synthetic_records = 1024
  c.ckpt.every_steps = 150
  c.eval.enabled = False
  c.eval.max_prompts = 16
  return c


@pytest.mark.slow
def test_golden_acceptance(tmp_path):
  config = _config()
  training.train_and_evaluate(config, str(tmp_path), progress=False)
  model, _ = training.restore_model(str(tmp_path))
  prompts = recipe.prompt_sets(config)['synthetic']
  gen = decode.generate(model, prompts, max_new_tokens=config.eval.max_new_tokens, draft_depth=2)
  online = metrics.acceptance_stats(np.concatenate(gen.accept_lengths), 2)['ar']
  plain = decode.generate(model, prompts, max_new_tokens=config.eval.max_new_tokens)
  assert all(np.array_equal(a, b) for a, b in zip(gen.tokens, plain.tokens))  # lossless
  tf = evaluate.teacher_forced(model, prompts, plain.tokens, 2)['ar']
  got = {'online_ar': [round(float(x), 4) for x in online], 'tf_ar': [round(float(x), 4) for x in tf]}
  if os.environ.get('GOLDEN_PRINT'):
    print('GOLDEN =', got)
  for key, want in GOLDEN.items():
    np.testing.assert_allclose(got[key], want, atol=TOL, err_msg=key)
