"""Tree drafts: the bookkeeping that `decode` uses when `DecodeOptions.tree` is set (docs/design.md).

A static tree of branching (b_1, ..., b_J) has P = Π b_j root-to-leaf paths. Path p takes, at
depth j, the token of rank r_pj (0 = argmax; sampling: the r_pj-th of b_j independent draws) of
the depth-j draft logits at its depth-(j-1) node, which are the head's logits on the path's own
earlier drafts (the chain's semantics, so paths that share a prefix draft the same tokens along
it: the tree has O = `num_nodes` distinct nodes, the pending token and the drafts). Drafting runs
each sequence as P rows, one per path (row b·P + p), each a chain in the same head calls; every
row reads its parent node's logits and its node's token from the row of the first path through
them (`DepthRows`), so rows that share a node agree exactly. Verifying is one trunk call over the
O nodes of each sequence with a tree attention mask (`verify_pass`), one trunk cache per sequence;
each path reads its nodes' logits as a chain verify call would give them. `accept` picks the path
to commit (greedy: the longest accepted; sampling: recursive rejection sampling down the tree):
every row adopts its tokens, logits and hidden states, and the trunk cache its nodes' slots
(`keep_path`). The rows' per-depth head caches need no copy: the next draft pass rewrites every
slot that was not final.
"""

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtpd_jax import sampling


def check(tree: tuple[int, ...], draft_depth: int) -> None:
  """Refuse a tree that decoding cannot run, in one line."""
  if tree and (len(tree) != draft_depth or any(b < 1 for b in tree)):
    raise ValueError(f'tree={tree} must give a branching >= 1 for each of the draft_depth={draft_depth} depths')


def num_paths(tree: tuple[int, ...]) -> int:
  """P: root-to-leaf paths of the tree (1 for a chain)."""
  return math.prod(tree) if tree else 1


def path_ranks(tree: tuple[int, ...]) -> np.ndarray:
  """[P, J]: the rank of path p's draft at depth j among its head's tokens (0 = the argmax),
  paths in lexicographic order, so path 0 is the chain."""
  return np.array(list(itertools.product(*(range(b) for b in tree))), np.int32).reshape(-1, len(tree))


def path_nodes(tree: tuple[int, ...]) -> np.ndarray:
  """[P, J+1]: the tree node that path p passes at depth j = 0..J. Node 0 is the root (the pending
  token); then come the nodes of depth 1, of depth 2, ..., each depth in lexicographic order of the
  ranks that lead to it, so paths sharing their first j ranks share their depth-j node."""
  sizes = np.cumprod(tree)                                   # nodes at depths 1..J
  offsets = np.concatenate([[1], 1 + np.cumsum(sizes)[:-1]])  # each depth's first node
  below = num_paths(tree) // sizes                           # paths under one node of each depth
  p_P = np.arange(num_paths(tree))
  nodes_PxJ = offsets[None, :] + p_P[:, None] // below[None, :]
  return np.concatenate([np.zeros((len(p_P), 1), np.int64), nodes_PxJ], axis=1).astype(np.int32)


def num_nodes(tree: tuple[int, ...]) -> int:
  """O: the root and every distinct draft of the tree, the tokens one tree attention pass verifies."""
  return 1 + int(np.cumprod(tree).sum())


def node_table(tree: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(depth_O, path_O, ancestor_OxO): each node's depth, the first path through it (whose row
  drafted its token) and which nodes it sees in the tree attention pass: itself and its ancestors."""
  nodes_PxJ1 = path_nodes(tree)
  n = num_nodes(tree)
  depth_O, path_O, ancestor_OxO = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros((n, n), bool)
  for p in reversed(range(len(nodes_PxJ1))):  # reversed: the first path through a node writes last
    for j, node in enumerate(nodes_PxJ1[p]):
      depth_O[node], path_O[node] = j, p
      ancestor_OxO[node, nodes_PxJ1[p, :j + 1]] = True
  return depth_O, path_O, ancestor_OxO


class DepthRows(NamedTuple):
  """How the R rows of a tree draft depth j (`depth_rows`)."""
  rank_R: np.ndarray    # the rank of the row's depth-j draft among its siblings
  width: int            # b_j, the siblings per parent
  parent_R: np.ndarray  # the row whose logits the row reads: the first path through its depth-(j-1) node
  node_R: np.ndarray    # the row whose draft the row takes: the first path through its depth-j node


def depth_rows(tree: tuple[int, ...], rows: int, j: int) -> DepthRows:
  """`DepthRows` of depth j (1-based) for R = B·P rows. Siblings have distinct first paths, so
  sampled siblings are independent draws from their parent's one distribution."""
  paths = num_paths(tree)
  owner_PxJ1 = node_table(tree)[1][path_nodes(tree)]
  owner_RxJ1 = np.repeat(np.arange(rows // paths) * paths, paths)[:, None] + np.tile(owner_PxJ1, (rows // paths, 1))
  return DepthRows(np.tile(path_ranks(tree)[:, j - 1], rows // paths), tree[j - 1],
                   owner_RxJ1[:, j - 1], owner_RxJ1[:, j])


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


def accept(key, tokens_RxJ1, draft_logits_RxJxV, logits_RxJ1xV, tree: tuple[int, ...], temperature: float,
           top_p: float = 1.0, num_drafts_R=None):
  """(src, a, next) per row: the row whose path the sequence commits, its accepted drafts and the
  token after them, from each path's view of the verify pass (`verify_pass`).

  Greedy: every path is verified as a chain (`sampling.verify`); the longest accepted one wins, the
  first on ties. Sampling: recursive rejection sampling down the tree (SpecInfer, Miao et al.
  2024): at the current node, with p the main head's law there and q its children's draft law,
  child c is accepted with probability min(1, p/q) under the p that its elder siblings' rejections
  left, each rejection replacing p by the normalised residual max(0, p - q); the walk moves to the
  first accepted child, and where none is (or none was proposed: adaptive depth), the next token
  is drawn from the current p. Each sibling is a speculative-sampling round with target p and an
  independent draw from q, so the emitted tokens follow plain sampling exactly (docs/design.md).
  """
  paths = num_paths(tree)
  if not temperature:
    a_R, next_R = sampling.verify(key, tokens_RxJ1[:, 1:], None, logits_RxJ1xV, 0.0, top_p, num_drafts_R)
    src_R = winners(a_R, paths)
    return src_R, a_R[src_R], next_R[src_R]
  depth_O, path_O, _ = node_table(tree)
  first_child_O = jnp.asarray(path_nodes(tree)[path_O, np.minimum(depth_O + 1, len(tree))])  # leaves: unused
  first_B = jnp.arange(tokens_RxJ1.shape[0] // paths) * paths
  row = lambda node_B: first_B + jnp.asarray(path_O)[node_B]  # the row of the first path through the node
  law = lambda logits_BxV: sampling.probs(logits_BxV, temperature, top_p)
  at = lambda p_BxV, x_B: jnp.take_along_axis(p_BxV, x_B[:, None], axis=1)[:, 0]
  node_B = jnp.zeros_like(first_B)
  p_BxV, alive_B = law(logits_RxJ1xV[first_B, 0]), jnp.ones(first_B.shape, bool)
  keys = jax.random.split(key, len(tree) + 1)
  for j, width in enumerate(tree):  # try the children, at depth j+1, of each walk's depth-j node
    q_BxV = law(draft_logits_RxJxV[row(node_B), j])
    trying_B = alive_B if num_drafts_R is None else alive_B & (j < num_drafts_R[row(node_B)])
    child_B, u_BxW = node_B, jax.random.uniform(keys[j], (len(first_B), width))
    for c in range(width):
      m_B = first_child_O[node_B] + c
      x_B = tokens_RxJ1[row(m_B), j + 1]
      ok_B = trying_B & sampling.accept_draft(u_BxW[:, c], at(p_BxV, x_B), at(q_BxV, x_B))
      child_B = jnp.where(ok_B, m_B, child_B)
      p_BxV = jnp.where((trying_B & ~ok_B)[:, None], sampling.residual(p_BxV, q_BxV), p_BxV)
      trying_B &= ~ok_B
    alive_B, node_B = child_B != node_B, child_B
    p_BxV = jnp.where(alive_B[:, None], law(logits_RxJ1xV[row(node_B), j + 1]), p_BxV)
  next_B = sampling.categorical(keys[-1], p_BxV)
  return tuple(jnp.repeat(x, paths) for x in (row(node_B), jnp.asarray(depth_O)[node_B], next_B))


def verify_pass(model, tokens_RxS, length_R, caches, tree: tuple[int, ...]):
  """One trunk call over each sequence's O distinct tree nodes (row b·P + p holds path p's drafts).

  Node n of depth j sits at position L+j (L: the pending token's) in cache slot L+n, and sees the
  committed prefix (slots < L) and its own ancestors. Returns each path's view, as a chain verify
  call gives it: (tokens, h^0, main logits) at its nodes of depth 0..J, R x (J+1), and the trunk
  caches, one row per sequence, with the nodes in slots L..L+O-1 (`keep_path` compacts them).
  """
  depth_O, path_O, ancestor_OxO = node_table(tree)
  paths, n, s = num_paths(tree), len(depth_O), tokens_RxS.shape[1]
  rows = tokens_RxS.shape[0]
  pending_B = length_R[::paths] - 1
  pos_BxO = pending_B[:, None] + depth_O
  tokens_BxO = tokens_RxS[jnp.arange(rows // paths)[:, None] * paths + path_O, pos_BxO]
  rel_BxS = jnp.arange(s) - pending_B[:, None]  # slot - L: < 0 the committed prefix, [0, O) the tree
  sees_BxOxS = jnp.take(jnp.asarray(ancestor_OxO), jnp.clip(rel_BxS, 0, n - 1), axis=1).transpose(1, 0, 2)
  mask_BxOxS = (rel_BxS < 0)[:, None, :] | (sees_BxOxS & (rel_BxS < n)[:, None, :])
  h_BxOxD, caches = model.trunk(tokens_BxO, pos_BxO, mask_BxOxS, caches, pending_B[:, None] + jnp.arange(n))
  logits_BxOxV = model.logits(h_BxOxD)
  seq_Rx1 = (jnp.arange(rows) // paths)[:, None]
  nodes_RxJ1 = jnp.tile(path_nodes(tree), (rows // paths, 1))
  return tokens_BxO[seq_Rx1, nodes_RxJ1], h_BxOxD[seq_Rx1, nodes_RxJ1], logits_BxOxV[seq_Rx1, nodes_RxJ1], caches


def keep_path(caches, length_R, src_R, tree: tuple[int, ...]):
  """Trunk caches (one row per sequence) where slots L+1..L+J hold the nodes of the winning path
  (row src's), as a chain's verify call would have written them; the other nodes' slots lie past
  the committed tokens, so no query sees them before the next pass rewrites them."""
  paths = num_paths(tree)
  pending_B, path_B = length_R[::paths] - 1, src_R[::paths] % paths
  from_BxJ = pending_B[:, None] + jnp.asarray(path_nodes(tree))[path_B, 1:]
  to_BxJ = pending_B[:, None] + jnp.arange(1, len(tree) + 1)
  seq_Bx1 = jnp.arange(len(pending_B))[:, None]
  return [{name: c.at[seq_Bx1, :, to_BxJ].set(c[seq_Bx1, :, from_BxJ], mode='drop') for name, c in cache.items()}
          for cache in caches]
