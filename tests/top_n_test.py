"""top_n_threshold selects what lax.top_k selects: exact on random, skewed, tied, infinite and bf16 rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpd_jax import top_n


def _threshold(logits, n):
  return jax.jit(lambda x: top_n.top_n_threshold(x, n, return_steps=True))(logits)


def _assert_top_n(logits, n, thr):
  """`logits > thr` is every logit >= the N-th largest (top_k's own value), and where the N-th
  and the (N+1)-th largest differ, exactly top_k's index set."""
  x = np.asarray(jnp.asarray(logits, jnp.float32))
  sel = x > np.asarray(thr)[..., None]
  values, idx = jax.lax.top_k(jnp.asarray(logits), n)
  kth = np.asarray(values[..., -1], np.float32)
  np.testing.assert_array_equal(sel, x >= kth[..., None])
  want = np.zeros(x.shape, bool)
  np.put_along_axis(want, np.asarray(idx), True, axis=-1)
  distinct = np.sum(x >= kth[..., None], axis=-1) == n  # no tie across the N-th
  np.testing.assert_array_equal(sel[distinct], want[distinct])
  return distinct


@pytest.mark.parametrize('shape,n', [
    ((3, 7), 1), ((3, 7), 3), ((3, 7), 6),
    ((2, 3, 100), 1), ((2, 3, 100), 17), ((2, 3, 100), 99),
    ((70, 3000), 1), ((70, 3000), 66), ((70, 3000), 243), ((70, 3000), 2999),
    *[pytest.param((1, 40, 33000), n, marks=pytest.mark.slow) for n in (1, 66, 667, 2673, 32999)],
])
def test_random_rows_select_the_top_k_set(shape, n):
  x = jax.random.normal(jax.random.key(n + shape[-1]), shape) * 3.0
  thr, steps = _threshold(x, n)
  assert thr.shape == shape[:-1]
  assert np.mean(_assert_top_n(x, n, thr)) > 0.9  # ties across the N-th are rare in f32 normals
  assert int(steps) <= 60


def test_n_at_least_v_selects_everything():
  x = jax.random.normal(jax.random.key(0), (2, 5, 11))
  for n in (11, 12):
    thr, _ = _threshold(x, n)
    np.testing.assert_array_equal(thr, -jnp.inf)


@pytest.mark.parametrize('v,n', [(3000, 1), (3000, 243), *[pytest.param(33000, n, marks=pytest.mark.slow)
                                                             for n in (1, 66, 667, 2673)]])
def test_skewed_lm_like_rows(v, n):
  # A few large logits over a long, nearly flat tail (log of a sparse Dirichlet).
  p = jax.random.dirichlet(jax.random.key(1), jnp.full((v,), 0.05), (24,))
  x = jnp.maximum(jnp.log(p + 1e-30), -60.0) + jax.random.uniform(jax.random.key(2), (24, v), maxval=1e-3)
  _assert_top_n(x, n, _threshold(x, n)[0])


@pytest.mark.parametrize('n', [1, 2, 5, 40, 333, 999])
def test_ties_select_every_logit_tied_with_the_nth(n):
  # Integers in [-4, 4] over 1000 logits: every N-th value is tied, many of them at zero.
  x = jax.random.randint(jax.random.key(n), (20, 1000), -4, 5).astype(jnp.float32)
  x = x.at[0].set(0.0).at[1].set(jnp.where(jnp.arange(1000) % 2 == 0, 0.0, -0.0))  # all ties
  thr, _ = _threshold(x, n)
  _assert_top_n(x, n, thr)
  np.testing.assert_array_equal(x[:2] > thr[:2, None], True)


def test_a_tie_of_the_two_largest_values():
  x = jnp.array([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0], [1.0, 1.0, -1.0, -2.0, -3.0, -4.0]])
  thr, _ = _threshold(x, 2)
  np.testing.assert_array_equal(x > thr[:, None], [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])


@pytest.mark.parametrize('n', [1, 7, 100, 290, 299])
def test_infinite_and_huge_logits(n):
  x = jax.random.normal(jax.random.key(3), (6, 300)) * jnp.array([1.0, 1e-30, 1e30, 1.0, 1.0, 1.0])[:, None]
  x = x.at[3, :10].set(jnp.inf).at[3, 10:20].set(3e38).at[3, 20:30].set(-3e38)
  x = x.at[4, ::3].set(-jnp.inf)  # 200 finite logits
  x = x.at[5, :150].set(-jnp.inf).at[5, 150:155].set(jnp.finfo(jnp.float32).max)
  thr, _ = _threshold(x, n)
  finite_enough = np.sum(np.asarray(x) > -np.inf, axis=-1) >= n
  _assert_top_n(x[finite_enough], n, thr[finite_enough])
  # Fewer than N logits above -inf: c = -inf and all of those are selected (never a -inf one).
  np.testing.assert_array_equal(thr[~finite_enough], -jnp.inf)


def test_a_row_of_only_minus_inf_selects_nothing():
  x = jnp.full((2, 50), -jnp.inf).at[1, :3].set(1.0)
  thr, _ = _threshold(x, 5)
  np.testing.assert_array_equal(np.asarray(x) > np.asarray(thr)[:, None], np.asarray(x) > -np.inf)


@pytest.mark.parametrize('v,n', [(3000, 1), (3000, 243), *[pytest.param(33000, n, marks=pytest.mark.slow)
                                                             for n in (1, 66, 667, 2673)]])
def test_bf16_rows_with_their_many_ties(v, n):
  x = (jax.random.normal(jax.random.key(n), (40, v)) * 2.0).astype(jnp.bfloat16)
  thr, steps = _threshold(x, n)
  _assert_top_n(x, n, thr)
  assert int(steps) <= 60


def test_rows_sharing_one_search_are_independent():
  # A row's threshold does not depend on the other rows of the batch (gathered stragglers).
  x = jax.random.normal(jax.random.key(4), (100, 4000))
  x = x.at[::7].multiply(50.0).at[::11].set(jnp.round(x[::11]))
  together, _ = _threshold(x, 300)
  for i in range(0, 100, 9):
    alone, _ = _threshold(x[i:i + 1], 300)
    np.testing.assert_array_equal(x[i] > together[i], x[i] > alone[0])
  _assert_top_n(x, 300, together)


def test_keys_order_floats_and_round_trip():
  x = jnp.array([-jnp.inf, -3e38, -1.5, -2.0 ** -126, -1e-40, -0.0, 0.0, 1e-40, 2.0 ** -126, 1.0, 1.5, 3e38, jnp.inf])
  for shift in (0, 16):
    grid = x if shift == 0 else x.astype(jnp.bfloat16).astype(jnp.float32)
    k = np.asarray(top_n._key(grid, shift), np.int64)
    assert np.all(np.diff(k) >= 0)
    back = top_n._from_key(top_n._key(grid, shift), shift)
    normal = np.abs(np.asarray(grid)) >= 2.0 ** -126
    np.testing.assert_array_equal(np.asarray(back)[normal], np.asarray(grid)[normal])
    np.testing.assert_array_equal(np.asarray(back)[~normal], 0.0)  # subnormals and -0.0 become 0.0
