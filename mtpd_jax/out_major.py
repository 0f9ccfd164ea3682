"""Out-major matrices: decoding on CPU stores each dense matrix as one O x I matrix and runs W @ x^T.

XLA:CPU runs a step's few rows fastest in that orientation (docs/design.md, "Decoding cost").
Every product with the weight matrices of attention, the MLP, the MTP projection and the output
head goes through `dense`; a module lists its matrices (and their input axes) in `MATRICES`, and
`out_major_params` / `set_out_major` make the same model read them out-major. MoE experts keep
their layout.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax


def dense(spec: str, x, w, out_major: bool = False, preferred_element_type=None):
  """einsum(spec, x, w) of x's trailing axes with w's leading ones, w cast to x's dtype.

  `out_major`: w is one O x I matrix (`out_major_params`); the product runs as W @ x^T behind an
  optimisation barrier (XLA would fold the transpose back), 5-15 rows padded with zeros to a multiple
  of 8, the row counts XLA:CPU's kernel runs fastest (docs/design.md, "Decoding cost").
  """
  w = w.astype(x.dtype)
  if not out_major:
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
  x_axes, w_axes = spec.split('->')[0].split(',')
  lead = x.shape[:x.ndim - len(set(x_axes) & set(w_axes))]
  n = x.size // w.shape[1]
  x_RxIn = jnp.pad(x.reshape(n, w.shape[1]), ((0, -n % 8 if 4 < n < 16 else 0), (0, 0)))
  y_OutxR = jnp.matmul(w, x_RxIn.T, preferred_element_type=preferred_element_type)
  return lax.optimization_barrier(y_OutxR).T[:n].reshape(*lead, w.shape[0])


def _out_major_modules(model):
  """(path, module) of every module whose `MATRICES` decoding may store out-major."""
  return [(path, node) for path, node in nnx.iter_graph(model) if hasattr(type(node), 'MATRICES')]


def out_major_params(model, params):
  """`params` (the state of `nnx.split(model, nnx.Param)`) with each matrix named in a module's
  `MATRICES` stored as one O x I matrix, the layout that `set_out_major` makes the model read."""
  in_axes = {(*path, name): n for path, module in _out_major_modules(model)
             for name, n in type(module).MATRICES.items()}

  def convert(keypath, x):
    n = in_axes.get(tuple(getattr(k, 'key', None) for k in keypath[:-1]))  # the last key: the Param's value
    return x if n is None else jnp.reshape(x, (-1, math.prod(x.shape[n:]))).T
  return jax.tree_util.tree_map_with_path(convert, params)


def set_out_major(model):
  """Make `model`, whose parameters come from `out_major_params`, read its matrices out-major."""
  for _, module in _out_major_modules(model):
    module.out_major = True
  return model
