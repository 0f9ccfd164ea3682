"""The threshold Top-N selection: exactly the top_k set of distinct logits (ties documented), and its masked KL."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpd_jax import losses, top_n
from conftest import distinct_logits


def _top_k_mask(logits, n):
  idx = jax.lax.top_k(logits, n)[1]
  return jnp.any(jax.nn.one_hot(idx, logits.shape[-1], dtype=bool), axis=-2)



@pytest.mark.parametrize('n', [1, 2, 17, 50, 99, 100])
def test_threshold_selects_exactly_the_top_k_set_of_distinct_logits(n):
  logits = distinct_logits(0, (3, 5, 100))
  thr, steps = top_n.top_n_threshold(logits, n, return_steps=True)
  np.testing.assert_array_equal(logits > thr[..., None], _top_k_mask(logits, n))
  assert int(steps) <= 64


@pytest.mark.parametrize('n', [1, 37, 299])
def test_threshold_stays_exact_where_the_last_open_rows_finish_gathered(n):
  logits = distinct_logits(11, (2, 64, 300))  # 128 rows: the last 16 open ones finish alone
  np.testing.assert_array_equal(logits > top_n.top_n_threshold(logits, n)[..., None], _top_k_mask(logits, n))


def test_threshold_on_a_wide_skewed_vocabulary_matches_top_k():
  # LM-like rows: a few large logits over a long tail; N is the paper's 8.1% of V.
  logits = jnp.log(jax.random.dirichlet(jax.random.key(3), jnp.full((4000,), 0.05), (16,)) + 1e-30)
  logits = jnp.maximum(logits, -60.0) + distinct_logits(4, (16, 4000), scale=1e-3)
  n = round(0.081 * 4000)
  thr = top_n.top_n_threshold(logits, n)
  np.testing.assert_array_equal(logits > thr[:, None], _top_k_mask(logits, n))


def test_ties_at_the_nth_value_are_all_selected():
  logits = jnp.array([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0],
                      [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
  sel = logits > top_n.top_n_threshold(logits, 2)[:, None]
  # Row 0: the 2nd largest value (3.0) is tied three ways: all three are kept.
  np.testing.assert_array_equal(sel, [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize('measure', losses.MEASURES)
@pytest.mark.parametrize('renormalize', [True, False])
def test_threshold_divergence_equals_gathered_top_k_divergence(measure, renormalize):
  t, s = distinct_logits(5, (2, 4, 64)), distinct_logits(6, (2, 4, 64), scale=5.0)
  idx, valid = losses.top_n_indices(t, s, 9, 'teacher')
  want = losses.distill_divergence(t, s, idx, valid, measure=measure, renormalize=renormalize, tau=0.7)
  got = losses.distill_divergence(t, s, measure=measure, renormalize=renormalize, tau=0.7,
                                  threshold_BxT=top_n.top_n_threshold(t, 9))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_threshold_union_counts_shared_indices_once():
  t = jnp.array([[[5.0, 4.0, 0.0, 0.1, 0.2, 0.3]]])
  s = jnp.array([[[4.0, 0.0, 0.1, 0.2, 0.3, 5.0]]])  # student top-2 = {5, 0}; 0 is shared
  got = losses.distill_divergence(t, s, threshold_BxT=top_n.top_n_threshold(t, 2),
                                  student_threshold_BxT=top_n.top_n_threshold(s, 2))
  sel = np.array([0, 1, 5])
  q = jax.nn.log_softmax(t[0, 0, sel])
  p = jax.nn.log_softmax(s[0, 0, sel])
  np.testing.assert_allclose(got[0, 0], jnp.sum(jnp.exp(q) * (q - p)), rtol=1e-5)


def test_threshold_n1_is_zero_and_n_equals_v_is_the_whole_vocabulary_kl():
  t, s = distinct_logits(7, (2, 3, 11)), distinct_logits(8, (2, 3, 11))
  kl1 = losses.distill_divergence(t, s, threshold_BxT=top_n.top_n_threshold(t, 1))
  np.testing.assert_array_equal(kl1, 0.0)
  klv = losses.distill_divergence(t, s, threshold_BxT=top_n.top_n_threshold(t, 11))
  np.testing.assert_allclose(klv, losses.distill_divergence(t, s), rtol=1e-5)
