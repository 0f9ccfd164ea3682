"""Tree drafts: the bookkeeping that `decode` uses when `DecodeOptions.tree` is set (docs/design.md).

A static tree of branching (b_1, ..., b_J) has P = Π b_j root-to-leaf paths. Path p takes, at
depth j, the token of rank r_pj (0 = argmax; sampling: the r_pj-th of b_j independent draws) of
the depth-j draft logits at its depth-(j-1) node, which are the head's logits on the path's own
earlier drafts (the chain's semantics, so paths that share a prefix draft the same tokens along
it: the tree has O = `num_nodes` distinct nodes, the pending token and the drafts). Each sequence
keeps P rows, one per path (row b·P + p, holding the path's drafts), but the head of depth j runs
once per node of depth j-1 (`DepthRows`), on the row of the first path through it, since every
path through a node has the same inputs there; the node drafts its b_j children and every row
takes its own node's draft and its parent's logits, so rows through a node agree exactly.
Verifying is one trunk call over the O nodes of each sequence with a tree attention mask
(`verify_pass`), one trunk cache per sequence; each path reads its nodes' logits as a chain verify
call would give them. `accept` picks the path to commit (greedy: the longest accepted; sampling:
recursive rejection sampling down the tree): every row adopts its tokens, logits and hidden
states, and the trunk cache its nodes' slots (`keep_path`). Depth j's head cache has one row per
node of depth j-1 and needs no copy: the next draft pass rewrites every slot that was not final.
"""

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


def level_sizes(tree: tuple[int, ...]) -> list[int]:
  """N_0, ..., N_J: the nodes at each depth (N_0 = 1, the root)."""
  return [math.prod(tree[:j]) for j in range(len(tree) + 1)]


def _level_starts(tree: tuple[int, ...]) -> np.ndarray:
  """[J+1]: each depth's first node id (nodes are numbered depth by depth: `path_nodes`)."""
  return np.concatenate([[0, 1], 1 + np.cumsum(level_sizes(tree)[1:-1])])[:len(tree) + 1].astype(np.int32)


def path_nodes(tree: tuple[int, ...]) -> np.ndarray:
  """[P, J+1]: the tree node that path p passes at depth j = 0..J. Node 0 is the root (the pending
  token); then come the nodes of depth 1, of depth 2, ..., each depth in lexicographic order of the
  ranks that lead to it, so paths sharing their first j ranks share their depth-j node, and node
  k's children at the next depth are k·b + 0..b-1 among that depth's nodes."""
  paths = num_paths(tree)
  below_J1 = paths // np.array(level_sizes(tree))  # paths under one node of each depth
  return (_level_starts(tree)[None, :] + np.arange(paths)[:, None] // below_J1[None, :]).astype(np.int32)


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
  """How a tree drafts depth j (`depth_rows`): the head runs once per node of depth j-1, on one
  group row each (G = B·N rows, N the nodes of depth j-1), not once per path."""
  width: int             # b_j: the children each node of depth j-1 drafts
  group_G: np.ndarray    # the row that stands for each group: the first path through its node
  parent_R: np.ndarray   # each row's group (its depth-(j-1) node): the draft logits it reads
  node_R: np.ndarray     # each row's depth-j node, as an index into the groups' drafts (G·b_j of them)


def depth_rows(tree: tuple[int, ...], rows: int, j: int) -> DepthRows:
  """`DepthRows` of depth j (1-based) for R = B·P rows: group g's b_j drafts, flattened, are the
  depth-j nodes in order (`path_nodes`)."""
  paths, sizes, first = num_paths(tree), level_sizes(tree), _level_starts(tree)
  nodes_PxJ1, path_O = path_nodes(tree), node_table(tree)[1]
  batch_B = np.arange(rows // paths)
  group_G = batch_B[:, None] * paths + path_O[first[j - 1] + np.arange(sizes[j - 1])]
  parent_R = batch_B[:, None] * sizes[j - 1] + nodes_PxJ1[:, j - 1] - first[j - 1]
  node_R = batch_B[:, None] * sizes[j] + nodes_PxJ1[:, j] - first[j]
  return DepthRows(tree[j - 1], group_G.ravel(), parent_R.ravel(), node_R.ravel())


def tile(state, paths: int, batch: int):
  """Every per-sequence array of a decoding state (leading axis `batch`) repeated as P rows."""
  return jax.tree.map(lambda x: jnp.repeat(x, paths, axis=0) if x.ndim and x.shape[0] == batch else x, state)


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
