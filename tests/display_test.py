"""The notebook view of a speculative generation: steps, accepted drafts, escaping."""

import numpy as np
import pytest

from benchmarks import tiny_heads
from mtpd_jax import decode
from mtpd_jax.harness import display
from mtpd_jax.model import ModelConfig

CFG = ModelConfig(vocab_size=32, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                  mlp_dim=64, num_mtp_heads=2, max_seq_len=128)


def test_step_chunks_split_prefill_then_drafts_plus_one():
  chunks = display.step_chunks([5, 6, 7, 8, 9, 10, 11], [2, 0, 3])
  # prefill: 5; step 1: drafts 6, 7 + main 8; step 2: main 9; step 3: cut after 10, 11 by the limit.
  assert chunks == [([5], 0), ([6, 7, 8], 2), ([9], 0), ([10, 11], 2)]
  with pytest.raises(ValueError, match='account for'):
    display.step_chunks([1, 2, 3, 4], [1])


def test_highlight_marks_exactly_the_accepted_drafts_and_escapes_text():
  text = display.highlight_html([1, 2, 3], [1], lambda ids: ''.join('<&'[i % 2] + str(i) for i in ids))
  assert f'<span style="{display.DRAFT_STYLE}">&lt;2</span>' in text
  assert text.count(display.DRAFT_STYLE) == 2  # the one accepted draft, and the legend
  assert f'<span style="{display.MAIN_STYLE}">&amp;1</span>' in text
  assert f'<span style="{display.MAIN_STYLE}">&amp;3</span>' in text


def test_step_chunks_account_for_a_real_generation():
  model = tiny_heads.train_tiny(CFG, steps=150, batch_size=8, seq_len=32, lr=3e-3)
  prompts = list(tiny_heads.synthetic_tokens(CFG.vocab_size, 8, range(2), seed=3))
  gen = decode.generate(model, prompts, max_new_tokens=20, draft_depth=2)
  for tokens, accepts in zip(gen.tokens, gen.accept_lengths):
    chunks = display.step_chunks(tokens, accepts)
    np.testing.assert_array_equal(np.concatenate([c for c, _ in chunks]), tokens)
    steps = [a for _, a in chunks[1:]]
    assert steps[:-1] == [int(a) for a in accepts][:len(steps) - 1]
    assert steps[-1] <= accepts[len(steps) - 1]  # the token limit may cut the last step short
    assert sum(a for _, a in chunks) > 0  # the trained heads draft something the main head accepts
