"""Metrics: AR/CAR bookkeeping on hand-made accept patterns, CAR = prod AR, teacher-forced chains."""

import math

import numpy as np
import pytest

from mtpd_jax import metrics


def test_acceptance_stats_on_a_hand_made_pattern():
  # 8 steps of depth 3; a = accepted drafts per step.
  stats = metrics.acceptance_stats([0, 1, 3, 2, 3, 0, 1, 3], 3)
  # depth 1 reached 8x, accepted 6x; depth 2 reached 6x, accepted 4x; depth 3 reached 4x, accepted 3x.
  np.testing.assert_allclose(stats['ar'], [6 / 8, 4 / 6, 3 / 4])
  np.testing.assert_allclose(stats['car'], [6 / 8, 4 / 8, 3 / 8])
  assert stats['accept_len'] == pytest.approx(13 / 8)  # the bonus token is not counted
  assert stats['tokens_per_forward'] == pytest.approx(1 + 13 / 8)  # the bonus token is
  assert stats['steps'] == 8


def test_per_prompt_counts_are_the_sums_that_give_each_prompts_ar1_and_tokens_per_forward():
  counts = metrics.per_prompt_counts([[0, 1, 3, 2], [], [0, 0, 2]])
  assert counts == {'steps': [4, 0, 3], 'accepted_1': [3, 0, 1], 'accepted': [6, 0, 2]}
  # Pooled over prompts they are acceptance_stats of all steps: AR1 = 4 / 7, 1 + 8 / 7 tokens per forward.
  stats = metrics.acceptance_stats([0, 1, 3, 2, 0, 0, 2], 3)
  assert stats['ar'][0] == pytest.approx(sum(counts['accepted_1']) / sum(counts['steps']))
  assert stats['tokens_per_forward'] == pytest.approx(1 + sum(counts['accepted']) / sum(counts['steps']))


def test_depth_never_reached_gives_nan_and_out_of_range_lengths_raise():
  stats = metrics.acceptance_stats([0, 1, 0], 3)
  assert stats['ar'][:2] == pytest.approx([1 / 3, 0.0]) and math.isnan(stats['ar'][2])
  assert stats['car'] == pytest.approx([1 / 3, 0.0, 0.0])
  empty = metrics.acceptance_stats([], 2)
  assert all(math.isnan(x) for x in empty['ar'] + empty['car']) and empty['steps'] == 0
  with pytest.raises(ValueError):
    metrics.acceptance_stats([0, 4], 3)


@pytest.mark.parametrize('seed', range(3))
def test_car_is_the_product_of_ar_and_sums_to_the_accepted_length(seed):
  rng = np.random.default_rng(seed)
  depth = 6
  a_Steps = np.minimum(rng.geometric(0.3, size=500) - 1, depth)  # leading-acceptance counts
  stats = metrics.acceptance_stats(a_Steps, depth)
  np.testing.assert_allclose(stats['car'], np.cumprod(stats['ar']), rtol=1e-12)
  assert sum(stats['car']) == pytest.approx(stats['accept_len'])


def test_teacher_forced_agreement_and_chains_by_hand():
  main_1xT = [[1, 2, 3, 4, 5, 6]]           # main at i predicts token i+1
  depth1_1xT = [[2, 0, 4, 5, 0, 0]]         # agrees with main at i+1 at i = 0, 2, 3
  depth2_1xT = [[3, 4, 0, 6, 0, 0]]         # agrees with main at i+2 at i = 0, 1, 3
  main, drafts = np.array(main_1xT), np.array([depth1_1xT, depth2_1xT])  # argmax ids
  agree = metrics.teacher_forced_agreement(main, drafts)
  np.testing.assert_array_equal(agree[:, 0], [[1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 0, 0]])
  # Chains need main logits up to i+2: starts 0..3. At i=1 depth 2 agrees but depth 1 does not.
  chains = metrics.teacher_forced_accept_lengths(main, drafts)
  np.testing.assert_array_equal(chains[0], [2, 0, 1, 2, -1, -1])
  valid = np.array([[False, True, True, True, True, True]])
  np.testing.assert_array_equal(metrics.teacher_forced_accept_lengths(main, drafts, valid)[0],
                                [-1, 0, 1, 2, -1, -1])
  stats = metrics.teacher_forced_stats(main, drafts)
  np.testing.assert_allclose(stats['ar'], [3 / 4, 2 / 3])   # conditional: depth 2 only after depth 1
  np.testing.assert_allclose(stats['car'], [3 / 4, 2 / 4])
  np.testing.assert_allclose(stats['agreement'], [3 / 4, 3 / 4])  # unconditional, same starts


def test_sequences_shorter_than_the_chain_have_no_chains():
  main, drafts = np.array([[1, 2]]), np.array([[[2, 0]]] * 3)
  np.testing.assert_array_equal(metrics.teacher_forced_agreement(main, drafts)[:, 0], [[1, 0], [0, 0], [0, 0]])
  np.testing.assert_array_equal(metrics.teacher_forced_accept_lengths(main, drafts), [[-1, -1]])
