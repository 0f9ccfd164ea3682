"""Top-N selection as a threshold: per row, the c with count(logits > c) = N, by count reductions.

Dimension letters: the legend in mtpd_jax/__init__.py.

`lax.top_k` sorts each row (on CPU it cost more than the whole KL it selects for); a threshold
needs only reductions over V, which vectorise on CPU and shard over a vocab-sharded mesh axis
(each step all-reduces one count per row). The set `logits > c` equals top_k's when the logits
are distinct; logits tied with the N-th largest are all selected.
"""

import statistics

import jax
import jax.numpy as jnp
from jax import lax


def above(d):
  """1.0 where d > 0, else 0.0, in arithmetic only: min(relu(d)·2^126, 1).

  XLA:CPU fuses arithmetic (not compare/select) into its vectorised reductions; a compare splits
  the fusion and writes a [.., V] mask, an extra pass over V. Exact for normal d; XLA:CPU
  flushes a subnormal d (|x - c| < 1.2e-38) to 0, i.e. "not above".
  """
  return jnp.minimum(jnp.maximum(d, 0.0) * 2.0 ** 126, 1.0)


def _order_key(x):
  """uint32 whose order is the float order of x (finite x; -0.0 sorts just below +0.0)."""
  b = lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(1 << 31))


def count_above(logits_BxTxV, c_BxT):
  """Number of logits > c in each row (an f32, exact below 2^24)."""
  return jnp.sum(above(logits_BxTxV - c_BxT[..., None]), axis=-1)


def top_n_threshold(logits_BxTxV, top_n: int, *, max_iters: int = 64, return_steps: bool = False):
  """Per row, a c with `logits > c` selecting the N largest logits (and any tied with the N-th).

  A bracketing search on count(logits > c), one count reduction over V per step. The first c is
  the normal quantile of the row's mean and spread; later ones interpolate the bracket's counts
  linearly to N + 1/2, with the Illinois rule (an end kept twice has its count gap halved) and a
  bisection after three steps that fail to halve the bracket; rows of LM-like logits (V=32k,
  N=8.1%) took at most 17-24 steps. Logits must be finite; rows whose bracket shrinks below 1e-30
  or to adjacent floats count as ties (all tied logits selected), and a row still open after
  max_iters steps keeps its lower end (at least N selected). Once at most an eighth of the rows
  (of 64 or more) is still open, those rows are gathered and finish alone: the last steps, where
  a count 1-3 away from N lands with about even odds per step, then read an eighth of the data.
  return_steps: also return the number of count reductions made (the slowest row's).
  """
  x = lax.stop_gradient(logits_BxTxV).astype(jnp.float32)
  v = x.shape[-1]
  if top_n >= v:
    lo = jnp.full(x.shape[:-1], -jnp.inf)
    return (lo, 0) if return_steps else lo
  row_shape = x.shape[:-1]
  x = x.reshape(-1, v)
  n = float(top_n)
  x_min, x_max = jnp.min(x, axis=-1), jnp.max(x, axis=-1)
  lo = x_min - (jnp.abs(x_min) * 2.0 ** -10 + 1.0)  # strictly below every logit: count = V
  hi = x_max                                        # count = 0
  mean = jnp.mean(x, axis=-1)
  std = jnp.sqrt(jnp.maximum(jnp.mean(x * x, axis=-1) - mean * mean, 0.0))
  first = mean + std * statistics.NormalDist().inv_cdf(1.0 - (n + 0.5) / v)
  zeros = jnp.zeros(lo.shape, jnp.float32)
  state = dict(lo=lo, hi=hi, g_lo=zeros + (v - n - 0.5), g_hi=zeros - (n + 0.5), n_lo=zeros + v,
               side=zeros, stall=zeros, width=hi - lo, it=0)

  def done(s):
    return (s['n_lo'] == n) | (_order_key(s['hi']) - _order_key(s['lo']) <= 1) | (s['hi'] - s['lo'] <= 1e-30)

  def cond(s):
    return (s['it'] < max_iters) & ~jnp.all(done(s))

  def body(s, x, first):
    lo, hi = s['lo'], s['hi']
    interp = jnp.where(s['it'] == 0, first, lo + (hi - lo) * (s['g_lo'] / (s['g_lo'] - s['g_hi'])))
    ok = (s['stall'] < 3) & (interp > lo) & (interp < hi)
    c = jnp.where(ok, interp, lo * 0.5 + hi * 0.5)
    cnt = count_above(x, c)
    active = ~done(s)
    up, down = active & (cnt >= n), active & (cnt < n)
    gap = cnt - n - 0.5  # the count's distance from N + 1/2, the interpolation target
    # Illinois: an end that survives a second step in a row has its gap halved, so the next
    # interpolation moves towards it instead of creeping along from the other side.
    g_lo = jnp.where(up, gap, jnp.where(down & (s['side'] < 0), s['g_lo'] * 0.5, s['g_lo']))
    g_hi = jnp.where(down, gap, jnp.where(up & (s['side'] > 0), s['g_hi'] * 0.5, s['g_hi']))
    lo, hi = jnp.where(up, c, lo), jnp.where(down, c, hi)
    halved = hi - lo <= 0.5 * s['width']
    return dict(lo=lo, hi=hi, g_lo=g_lo, g_hi=g_hi, n_lo=jnp.where(up, cnt, s['n_lo']),
                side=jnp.where(up, 1.0, jnp.where(down, -1.0, s['side'])),
                stall=jnp.where(halved, 0.0, s['stall'] + 1.0), width=jnp.where(halved, hi - lo, s['width']),
                it=s['it'] + 1)
  rows = x.shape[0]
  tail = rows // 8  # the last, slowest steps run on the (at most) `tail` rows still open
  if tail >= 8:
    s = lax.while_loop(lambda s: cond(s) & (jnp.sum(~done(s)) > tail), lambda s: body(s, x, first), state)
    idx = lax.top_k((~done(s)).astype(jnp.float32), tail)[1]  # every open row, then done ones
    x_sub, first_sub = x[idx], first[idx]
    sub = lax.while_loop(cond, lambda t: body(t, x_sub, first_sub),
                         jax.tree.map(lambda a: a if a.ndim == 0 else a[idx], s))
    s = {k: (sub[k] if a.ndim == 0 else a.at[idx].set(sub[k])) for k, a in s.items()}
  else:
    s = lax.while_loop(cond, lambda s: body(s, x, first), state)
  lo = s['lo'].reshape(row_shape)
  return (lo, s['it']) if return_steps else lo


