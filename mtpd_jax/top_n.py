"""Top-N selection as a threshold: per row, the c with count(logits > c) = N, by count reductions.

Dimension legend: B batch, T positions, V vocab, N Top-N selected logits; R rows (B·T), M logits
sampled per row, P thresholds per row, H rows gathered.

`lax.top_k` sorts each row (on CPU it cost more than the whole KL it selects for); a threshold
needs only reductions over V, which vectorise on CPU and shard over a vocab-sharded mesh axis
(each step all-reduces one count per row). A count costs a pass over the row, so the search
brackets the N-th largest logit on a strided sample of M ≈ 1024 logits first (passes of M, not
V), checks the bracket with one pass over V and refines it there; once most rows are done, the
open ones are gathered, so the slowest rows do not cost passes over every row. On rows of
V = 32k (N = 8.1%) that is 8-12 passes' worth in place of about 20 (about half the time).

The set `logits > c` equals top_k's when the logits are distinct; logits tied with the N-th
largest are all selected. +inf logits rank first; -inf logits are never selected (when fewer
than N logits exceed -inf, c = -inf and all others are); N >= V gives c = -inf. Logits must not
be NaN. Differences below 2^-126 count as zero (XLA:CPU flushes subnormals; see `above`), so
thresholds are never subnormal and logits closer than that to the N-th largest count as tied.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

_SAMPLE = 1024    # logits per row in the sample (about; a stride of V // 1024)
_Z = 4.0          # the sample bracket's half-width, in standard deviations of the sampled rank
_STRAGGLERS = 16  # the fewest rows that a pass gathers (see `_refine`)
_SHRINK = 0.25    # a pass gathers the open rows once no more than this fraction of its rows is
_MAX_ITERS = 400  # never reached: every 4th step at least halves a bracket's keys (32 times at
                  # most) or its count gap (24 times at most)


def above(d):
  """1.0 where d > 0, else 0.0, in arithmetic only: min(relu(d)·2^126, 1).

  XLA:CPU fuses arithmetic (not compare/select) into its vectorised reductions; a compare splits
  the fusion and writes a [.., V] mask (about 3x slower per pass). Exact for normal d; XLA:CPU
  flushes a subnormal d (|x - c| < 1.2e-38) to 0, i.e. "not above".
  """
  return jnp.minimum(jnp.maximum(d, 0.0) * 2.0 ** 126, 1.0)


def count_above(logits_BxTxV, c_BxT):
  """Number of logits > c in each row (an f32, exact below 2^24)."""
  return jnp.sum(above(logits_BxTxV - c_BxT[..., None]), axis=-1)


def _counts(x_RxV, c_RxP):
  """count_above for P thresholds per row, as one reduction over V (XLA:CPU fuses sibling
  reductions of the same x into one loop that runs about 10x slower than each alone)."""
  if c_RxP.shape[-1] == 1:
    return count_above(x_RxV, c_RxP[:, 0])[:, None]
  return jnp.sum(above(x_RxV[:, None, :] - c_RxP[..., None]), axis=-1)


# Thresholds live on an integer grid of keys: `_key` orders floats like their values, with zero
# and the subnormals (which XLA:CPU flushes to zero) as one point, so a bisection of keys halves
# the floats between two thresholds (at most 32 steps) and never proposes a subnormal threshold.
# Logits of a narrower type (bfloat16, float16) search the keys of that type's values only
# (`shift` drops the mantissa bits it lacks): 16 bisections, and ties, which such logits have at
# almost every N-th value, close in as few steps.


def _grid(dtype):
  """The key shift of logits of this dtype: the f32 mantissa bits its values leave at zero."""
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).nmant >= 23:
    return 0
  return 23 - int(jnp.finfo(dtype).nmant)


def _key_zero(shift):
  return (0x7F800000 >> shift) - (0x00800000 >> shift) + 1  # the key of 0.0; of +inf: twice that


def _key(x, shift=0):
  """uint32 key of f32 x (not NaN): monotone, with all |x| < 2^-126 at the key of 0.0."""
  mag = jnp.maximum((lax.bitcast_convert_type(jnp.abs(x), jnp.int32) >> shift) - ((0x00800000 >> shift) - 1), 0)
  signed = jnp.where(x < 0, -mag, mag)
  return lax.bitcast_convert_type(signed, jnp.uint32) + jnp.uint32(_key_zero(shift))


def _from_key(k, shift=0):
  """The f32 on the grid with key k (`_from_key(_key(x))` rounds x towards zero onto the grid)."""
  signed = lax.bitcast_convert_type(k - jnp.uint32(_key_zero(shift)), jnp.int32)
  mag = jnp.abs(signed)
  f = lax.bitcast_convert_type(jnp.where(mag == 0, 0, (mag + ((0x00800000 >> shift) - 1)) << shift), jnp.float32)
  return jnp.where(signed < 0, -f, f)


def _grid_max(shift):
  """The largest finite float on the grid."""
  return _from_key(jnp.uint32(2 * _key_zero(shift) - 1), shift)


def _search(x_RxV, s, w_min, w_max, *, shift: int, max_iters: int, leave_open: int = 0):
  """Moves each row's bracket until count(x > lo) <= w_max (all but `leave_open` rows); returns
  the state and the number of steps.

  State `s`: per row and threshold ([R, P]) grid points lo < hi with n_lo = count(x > lo) >=
  w_min > n_hi = count(x > hi). Each step counts at one c: the bracket's counts interpolated
  linearly to the middle of the window, with the Illinois rule (an end kept twice has its count
  gap halved), or the key midpoint after two steps that halve neither the bracket's count gap nor
  its keys. Rows whose keys are adjacent are done too: no grid point lies between lo and the
  w_min-th largest logit, so `x > lo` selects it and every logit tied with it.
  """
  # Counts interpolate as normal quantiles, z(count) = Φ⁻¹(1 - count/V): a row's logits are
  # closer to normal than to uniform, and narrow brackets interpolate as linearly as in counts.
  v = x_RxV.shape[-1]
  z = lambda cnt: jax.scipy.special.ndtri(1.0 - jnp.clip(cnt, 0.5, v - 0.5) / v)
  z_target = z((w_min + w_max + 1) * 0.5)  # count N + 1/2 when w_min = w_max = N
  key = lambda a: _key(a, shift)

  def open_(s):
    return (s['n_lo'] > w_max) & (key(s['hi']) - key(s['lo']) > 1)

  def cond(s):
    return (s['it'] < max_iters) & (jnp.sum(open_(s)) > leave_open)

  def body(s):
    lo, hi = s['lo'], s['hi']
    f = s['g_lo'] / (s['g_lo'] - s['g_hi'])
    width = hi - lo  # inf for brackets wider than the largest float: interpolate in convex form
    interp = jnp.where(jnp.isfinite(width), lo + width * f, lo * (1.0 - f) + hi * f)
    interp = _from_key(key(jnp.where(jnp.isnan(interp), lo, interp)), shift)
    k_lo, k_hi = key(lo), key(hi)
    # A bracket that stalls is halved: in value, then (if that stalls too) in keys, which cross
    # the exponents near zero and the huge brackets of ±max in at most 32 halvings.
    mid = jnp.where((s['stall'] == 2) & jnp.isfinite(width), _from_key(key(lo + width * 0.5), shift),
                    _from_key(k_lo + (k_hi - k_lo) // 2, shift))
    mid = jnp.where((mid > lo) & (mid < hi), mid, _from_key(k_lo + (k_hi - k_lo) // 2, shift))
    c = jnp.where((s['stall'] < 2) & (interp > lo) & (interp < hi), interp, mid)
    cnt = _counts(x_RxV, c)
    act = open_(s)
    up, down = act & (cnt >= w_min), act & (cnt < w_min)
    gap = z_target - z(cnt)  # > 0 below the target, < 0 above
    g_lo = jnp.where(up, gap, jnp.where(down & (s['side'] < 0), s['g_lo'] * 0.5, s['g_lo']))
    g_hi = jnp.where(down, gap, jnp.where(up & (s['side'] > 0), s['g_hi'] * 0.5, s['g_hi']))
    lo, hi = jnp.where(up, c, lo), jnp.where(down, c, hi)
    n_lo, n_hi = jnp.where(up, cnt, s['n_lo']), jnp.where(down, cnt, s['n_hi'])
    kw, cw = key(hi) - key(lo), n_lo - n_hi
    progress = (kw <= s['kw'] // 2) | (cw <= s['cw'] * 0.5)
    return dict(lo=lo, hi=hi, n_lo=n_lo, n_hi=n_hi, g_lo=g_lo, g_hi=g_hi,
                side=jnp.where(up, 1, jnp.where(down, -1, s['side'])),
                stall=jnp.where(progress, 0, s['stall'] + 1), kw=jnp.where(progress, kw, s['kw']),
                cw=jnp.where(progress, cw, s['cw']), it=s['it'] + 1)

  s = dict(s, g_lo=z_target - z(s['n_lo']), g_hi=z_target - z(s['n_hi']), side=jnp.zeros(s['lo'].shape, jnp.int32),
           stall=jnp.zeros(s['lo'].shape, jnp.int32), kw=key(s['hi']) - key(s['lo']), cw=s['n_lo'] - s['n_hi'],
           it=jnp.int32(0))
  s = lax.while_loop(cond, body, s)
  return {k: s[k] for k in ('lo', 'hi', 'n_lo', 'n_hi')}, s['it']


def top_n_threshold(logits_BxTxV, top_n: int, *, return_steps: bool = False):
  """Per row, a c with `logits > c` selecting the N largest logits (and any tied with the N-th).

  1. Sample: every (V // 1024)-th logit of the row. Of M sampled logits about a = N·M/V exceed
     the N-th largest, give or take sqrt(a·(1 - a/M)); a search over the sample (passes of M)
     finds c_lo and c_hi with about a + 4 and a - 4 of those deviations above them.
  2. Check: one pass over V counts above c_lo and c_hi and takes the row's max and min. The
     bracket is the closest of them with count >= N below and count < N above (the row's min
     and max when the sample missed: exact either way, only slower).
  3. Refine: the search on the full rows until count(x > lo) = N (or no grid point lies between
     lo and hi: ties), on fewer rows as they finish (`_refine`).
  return_steps: also return the number of passes over V of the slowest row (check included).
  """
  shift = _grid(logits_BxTxV.dtype)
  x = lax.stop_gradient(logits_BxTxV).astype(jnp.float32)
  v = x.shape[-1]
  if top_n >= v:
    lo = jnp.full(x.shape[:-1], -jnp.inf)
    return (lo, 0) if return_steps else lo
  x_RxV = x.reshape(-1, v)
  r, n = x_RxV.shape[0], float(top_n)
  fmax = _grid_max(shift)
  below = lambda a: _from_key(_key(a - (jnp.abs(a) * 2.0 ** -6 + 1.0), shift), shift)  # a grid point < a

  # 1. The sample, clipped so that its bracket ends stay finite (its thresholds are guesses).
  y_RxM = jnp.clip(x_RxV[:, ::max(1, v // _SAMPLE)], -fmax / 4, fmax / 4)
  m = y_RxM.shape[-1]
  a = n * m / v
  dev = _Z * math.sqrt(a * (1.0 - a / m)) + 2.0
  w_min = jnp.array([min(math.ceil(a + dev), m), max(math.floor(a - 1.5 * dev), 1)], jnp.float32)
  w_max = jnp.array([min(math.ceil(a + 1.5 * dev), m), max(math.floor(a - dev), 1)], jnp.float32)
  zeros = jnp.zeros((r, 2), jnp.float32)
  s = dict(lo=zeros + below(jnp.min(y_RxM, axis=-1))[:, None], hi=zeros + jnp.max(y_RxM, axis=-1)[:, None],
           n_lo=zeros + m, n_hi=zeros)
  s, _ = _search(y_RxM, s, w_min, w_max, shift=shift, max_iters=_MAX_ITERS)
  c_Rx2 = s['lo']  # [c_lo, c_hi]: about a + 4 and a - 4 deviations of sampled logits above them

  # 2. The check: the closest of c_lo, c_hi with count >= N below and count < N above. Where the
  # sample missed (and for N below its resolution), the row's max (count 0) is the upper end, a
  # grid point below its min the lower one. Max and min are separate, rarely run reductions.
  n_Rx2 = _counts(x_RxV, c_Rx2)
  as_lo = n_Rx2 >= n
  i_lo = jnp.argmax(jnp.where(as_lo, c_Rx2, -jnp.inf), axis=-1)[:, None]
  i_hi = jnp.argmin(jnp.where(as_lo, jnp.inf, c_Rx2), axis=-1)[:, None]
  lo, n_lo = (jnp.take_along_axis(a, i_lo, axis=-1)[:, 0] for a in (c_Rx2, n_Rx2))
  hi, n_hi = (jnp.take_along_axis(a, i_hi, axis=-1)[:, 0] for a in (c_Rx2, n_Rx2))
  no_lo, no_hi = n_lo < n, n_hi >= n

  def row_max():
    return jnp.where(no_hi, jnp.max(x_RxV, axis=-1), hi), jnp.where(no_hi, 0.0, n_hi)

  def below_min():  # count above it only where the min is -inf or the grid's -max
    x_min = jnp.min(x_RxV, axis=-1)
    lo0 = jnp.where(x_min > -fmax, jnp.maximum(below(x_min), -fmax), -fmax)
    n_lo0 = lax.cond(jnp.any(no_lo & (x_min <= -fmax)), lambda: count_above(x_RxV, lo0),
                     lambda: jnp.full(lo0.shape, float(v)))
    return jnp.where(no_lo, lo0, lo), jnp.where(no_lo, n_lo0, n_lo)

  hi, n_hi = lax.cond(jnp.any(no_hi), row_max, lambda: (hi, n_hi))
  lo, n_lo = lax.cond(jnp.any(no_lo), below_min, lambda: (lo, n_lo))
  none = n_lo < n  # fewer than N logits above -max: the N-th largest is -inf (or -max)
  lo, n_lo, hi = jnp.where(none, -jnp.inf, lo), jnp.where(none, n, n_lo), jnp.where(none, jnp.inf, hi)

  # 3. Refine; as rows finish, the open ones are gathered into halves, then quarters, ... of R.
  s = dict(lo=lo[:, None], hi=hi[:, None], n_lo=n_lo[:, None], n_hi=n_hi[:, None])
  s, steps = _refine(x_RxV, s, n, shift)
  lo = s['lo'][:, 0].reshape(x.shape[:-1])
  return (lo, steps + 1) if return_steps else lo


def _refine(x_RxV, s, n, shift):
  """The search for count(x > lo) = N on every row; returns the state and its passes over V.

  The rows of a pass need not be all R: once no more than a quarter are open, those are gathered
  (R/4 rows, each pass a quarter of the cost), and so on down to `_STRAGGLERS` rows, which finish.
  """
  r = x_RxV.shape[0]
  w = jnp.full((1,), n)
  if r <= _STRAGGLERS:
    return _search(x_RxV, s, w, w, shift=shift, max_iters=_MAX_ITERS)
  h = max(int(r * _SHRINK), _STRAGGLERS)
  s, steps = _search(x_RxV, s, w, w, shift=shift, max_iters=_MAX_ITERS, leave_open=h)
  open_R = (s['n_lo'][:, 0] > n) & (_key(s['hi'][:, 0], shift) - _key(s['lo'][:, 0], shift) > 1)
  idx_H = lax.top_k(open_R.astype(jnp.float32), h)[1]
  s_H, steps_h = _refine(x_RxV[idx_H], jax.tree.map(lambda a: a[idx_H], s), n, shift)
  return jax.tree.map(lambda a, b: a.at[idx_H].set(b), s, s_H), steps + steps_h
