"""Tree drafts as batched paths: the bookkeeping that `decode` uses when `DecodeOptions.tree` is set.

A static tree of branching (b_1, ..., b_J) has P = Π b_j root-to-leaf paths. Path p takes, at
depth j, the token of rank r_pj (0 = argmax) of its own depth-j draft logits, which are the
head's logits on the path's own earlier drafts (the chain's semantics, so paths that share a
prefix draft the same tokens along it). Each sequence of the batch runs as P rows, one per path
(row b·P + p): every row drafts and is verified exactly as a chain, all P in the same trunk and
head calls. After verification each sequence keeps the path that accepted the most drafts
(the first on ties) and every one of its rows adopts that path's result: the accepted tokens,
the main logits, the trunk's hidden states and the trunk cache slots just written. The rows'
per-depth head caches need no copy: the next draft pass rewrites every slot that was not final
(docs/design.md, "Decoding cost").

Greedy only: a sampled tree needs a multi-candidate acceptance rule (recursive rejection sampling
over siblings), which is not implemented, so `DecodeOptions` refuses temperature > 0 with a tree.
Compared with one tree attention pass over the distinct nodes, batched paths compute shared
prefixes once per path and keep a trunk cache per path: simple and exact, at P times the chain's
compute (on an accelerator at batch 1, where a step reads the weights once for all rows, that is
the cheap direction).
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np


def check(tree: tuple[int, ...], draft_depth: int, temperature: float) -> None:
  """Refuse a tree that decoding cannot run, in one line."""
  if not tree:
    return
  if len(tree) != draft_depth or any(b < 1 for b in tree):
    raise ValueError(f'tree={tree} must give a branching >= 1 for each of the draft_depth={draft_depth} depths')
  if temperature:
    raise ValueError('tree drafting is greedy only (a sampled tree needs recursive rejection sampling over '
                     'siblings, which is not implemented): use temperature=0 or no tree')


def num_paths(tree: tuple[int, ...]) -> int:
  """P: root-to-leaf paths of the tree (1 for a chain)."""
  return math.prod(tree) if tree else 1


def path_ranks(tree: tuple[int, ...]) -> np.ndarray:
  """[P, J]: the rank of path p's draft at depth j among its head's tokens (0 = the argmax),
  paths in lexicographic order, so path 0 is the chain."""
  return np.array(list(itertools.product(*(range(b) for b in tree))), np.int32).reshape(-1, len(tree))


def tile(state, paths: int, batch: int):
  """Every per-sequence array of a decoding state (leading axis `batch`) repeated as P rows."""
  return jax.tree.map(lambda x: jnp.repeat(x, paths, axis=0) if x.ndim and x.shape[0] == batch else x, state)


def ranked(logits_RxV, ranks_R, width: int):
  """Row r's token of rank ranks_R[r] in its logits (rank < width; ties: the lower index first)."""
  top_RxW = jax.lax.top_k(logits_RxV, width)[1]
  return jnp.take_along_axis(top_RxW, ranks_R[:, None], axis=1)[:, 0].astype(jnp.int32)


def winners(accepted_R, paths: int):
  """For each row, the row of its sequence whose path accepted the most drafts (first on ties)."""
  acc_BxP = accepted_R.reshape(-1, paths)
  best_B = jnp.arange(acc_BxP.shape[0]) * paths + jnp.argmax(acc_BxP, axis=1)
  return jnp.repeat(best_B, paths)


def adopt_slots(caches, src_R, pos_RxW):
  """Trunk caches where each row's slots `pos` hold those of row src: the winning path's keys and
  values at the positions the verify call just wrote (cache layout B x G x S x E)."""
  rows_Rx1 = jnp.arange(src_R.shape[0])[:, None]
  return [{name: c.at[rows_Rx1, :, pos_RxW].set(c[src_R[:, None], :, pos_RxW], mode='drop')
           for name, c in cache.items()} for cache in caches]
