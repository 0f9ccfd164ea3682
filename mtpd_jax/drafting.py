"""Drafting for self-speculative decoding: what a step proposes, and the bookkeeping of a tree.

Dimension letters: the legend in mtpd_jax/__init__.py. A `DraftPlan` says how a speculative step
drafts (docs/design.md, "Decoding cost"):
- a chain of `depth` = J drafts: depth j runs head ((j-1) mod K)+1 (training-free looping, MTP-D*
  of Table 8, past K) on the depth j-1 hidden states and the token j ahead (`draft`);
- a static `tree` of branching (b_1, ..., b_J): P = Π b_j root-to-leaf paths, whose drafts are
  verified together in one tree attention pass of the trunk (`verify_pass`);
- adaptive depth (`min_prob`): a sequence proposes only its leading drafts whose head put at least
  that on its most likely token, a choice made before any draw, so sampling stays lossless;
- a draft vocabulary (`vocab`): drafts are chosen among those token ids only (a head vocabulary,
  or the most frequent training tokens); verification keeps the main head over all of V.

`decode.py` owns the loop (state, commit, prefill, step) and calls `draft` after each verify; this
file takes arrays and the plan and never imports decode.

Trees. Path p takes, at depth j, the token of rank r_pj (0 = argmax; sampling: the r_pj-th of b_j
independent draws) of the depth-j draft logits at its depth-(j-1) node, which are the head's
logits on the path's own earlier drafts (the chain's semantics, so paths that share a prefix draft
the same tokens along it: the tree has O = `num_nodes` distinct nodes, the pending token and the
drafts). Each sequence keeps P rows, one per path (row b·P + p), but the head of depth j runs once
per node of depth j-1 (`DepthRows`), on the row of the first path through it, and every row takes
its own node's draft and its parent's logits, so rows through a node agree exactly. Verifying is
one trunk call over the O nodes of each sequence with a tree attention mask, one trunk cache per
sequence; each path reads its nodes' logits as a chain verify call would give them. `accept`
picks the path to commit (greedy: the longest accepted; sampling: recursive rejection sampling
down the tree): every row adopts its tokens, logits and hidden states, and the trunk cache its
nodes' slots (`keep_path`). Depth j's head cache has one row per node of depth j-1 and needs no
copy: the next draft pass rewrites every slot that was not final.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtpd_jax import sampling
from mtpd_jax.model import MTPTransformer, cache_mask
from mtpd_jax.shifts import gather_at, write_at


# ---------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class DraftPlan:
  """How a speculative step drafts; `DraftPlan()` (depth 0) is plain decoding. Static: one
  compilation per distinct plan."""
  depth: int = 0                  # J drafts per step; past K the heads loop
  tree: tuple[int, ...] = ()      # branching per depth, one per draft depth; () = a chain
  min_prob: float = 0.0           # adaptive depth: stop drafting below this top probability (0 = always J)
  vocab: tuple[int, ...] = ()     # token ids that drafts are chosen among; () = all of V

  def __post_init__(self):
    object.__setattr__(self, 'tree', tuple(int(b) for b in self.tree))
    object.__setattr__(self, 'vocab', tuple(int(i) for i in self.vocab))
    object.__setattr__(self, 'min_prob', float(self.min_prob) if self.depth else 0.0)
    if self.depth < 0:
      raise ValueError(f'draft depth {self.depth} must be >= 0 (0 = plain decoding)')
    if not 0.0 <= self.min_prob <= 1.0:
      raise ValueError(f'draft_min_prob={self.min_prob} must lie in [0, 1]')
    check(self.tree, self.depth)
    if self.vocab and (min(self.vocab) < 0 or len(set(self.vocab)) != len(self.vocab)):
      raise ValueError('draft vocabulary ids must be distinct and >= 0')

  @property
  def paths(self) -> int:
    return num_paths(self.tree)

  @property
  def verified(self) -> int:
    """Positions one verify call writes: the pending token and the drafts (a tree's O nodes)."""
    return num_nodes(self.tree) if self.tree else self.depth + 1

  def check_vocab(self, vocab_size: int) -> None:
    if self.vocab and max(self.vocab) >= vocab_size:
      raise ValueError(f'draft vocabulary ids must be distinct and in [0, {vocab_size})')


def vocab_ids(ids) -> tuple[int, ...]:
  """A draft vocabulary's ids as a tuple; anything but a non-empty 1-D integer array raises ValueError."""
  ids = np.asarray(ids)
  if ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f'a draft vocabulary is a non-empty 1-D array of token ids, got shape {ids.shape} {ids.dtype}')
  return tuple(ids.tolist())


def head_for_depth(j: int, num_heads: int) -> int:
  """The MTP head (1-based) that drafts at depth j: ((j-1) mod K)+1."""
  return (j - 1) % num_heads + 1


class DraftVocab(NamedTuple):
  """A draft vocabulary: drafts are chosen among U token ids only. Verification uses the main head
  over the whole vocabulary, so decoding stays lossless: a sampled draft's q is a proper
  distribution over the U ids, zero elsewhere, which min(1, p/q) accepts exactly (docs/design.md)."""
  ids_U: jax.Array    # int32 token ids
  w: jax.Array        # their entries of the model's `output_matrix()` (D x U, or U x D out-major)


def draft_vocab(model: MTPTransformer, ids_U) -> DraftVocab:
  """The draft vocabulary of these token ids (gathered once, outside the decoding loop)."""
  ids_U = jnp.asarray(ids_U, jnp.int32)
  return DraftVocab(ids_U, jnp.take(model.output_matrix(), ids_U, axis=0 if model.out_major else 1))


# ---------------------------------------------------------------------------------------------
# Drafting


def draft(model: MTPTransformer, plan: DraftPlan, tokens_BxS, length_B, h0_BxSxD, head_caches, start_B,
          width: int, key, vocab: DraftVocab | None, temperature: float, top_p: float):
  """Re-run depths 1..J over positions [start, start+width) and draft tokens L+1..L+J.

  Depth j at window position i reads h^{j-1}_i and token i+j, and predicts token i+j+1; the
  window covers every head-cache slot that was not final after the previous pass (decode.py's
  cache scheme). Returns (tokens_BxS with the drafts written, the head caches, the draft logits
  [B, J, V] when sampling reads them, else None, and with adaptive depth the drafts each
  sequence proposes, else None).
  """
  s = tokens_BxS.shape[1]
  pos_BxW = start_B[:, None] + jnp.arange(width)
  mask_BxWxS = cache_mask(pos_BxW, s)
  pending_B = length_B - 1
  last_Bx1 = (pending_B - 1 - start_B)[:, None]  # window index of the last trunk position L-1
  h_BxWxD = gather_at(h0_BxSxD, pos_BxW)
  caches, draft_logits = [], []
  drafting_B, num_drafts_B = jnp.ones(pending_B.shape, bool), jnp.zeros_like(pending_B)  # adaptive depth
  for j, key_j in zip(range(1, plan.depth + 1), jax.random.split(key, plan.depth)):
    rows = depth_rows(plan.tree, len(pending_B), j) if plan.tree else None
    group = (lambda x: x) if rows is None else (lambda x: x[rows.group_G])
    if rows is not None:  # a tree runs depth j once per node of depth j-1, on its first path's row
      h_BxWxD = group(h_BxWxD) if j == 1 else jnp.repeat(h_BxWxD, plan.tree[j - 2], axis=0)  # parent's states
    h_BxWxD, cache = model.mtp_head(head_for_depth(j, model.cfg.num_mtp_heads), h_BxWxD,
                                    group(gather_at(tokens_BxS, pos_BxW + j)), group(pos_BxW), group(mask_BxWxS),
                                    head_caches[j - 1])
    h_Bx1xD = gather_at(h_BxWxD, group(last_Bx1))
    choose = functools.partial(_choose_draft, model, vocab, temperature, top_p, key_j, rows)
    if plan.min_prob and j > 1:  # skip the logits once no sequence drafts this deep
      skip = lambda _: (jnp.zeros(pending_B.shape, jnp.int32), jnp.zeros(pending_B.shape + (model.cfg.vocab_size,)))
      draft_B, logits_BxV = jax.lax.cond(jnp.any(drafting_B), choose, skip, h_Bx1xD)
    else:
      draft_B, logits_BxV = choose(h_Bx1xD)
    if plan.min_prob:
      drafting_B &= draft_confidence(logits_BxV, draft_B, temperature, top_p) >= plan.min_prob
      num_drafts_B += drafting_B
    tokens_BxS = write_at(tokens_BxS, (pending_B + j)[:, None], draft_B[:, None])
    caches.append(cache)
    draft_logits.append(logits_BxV)
  # Greedy verification reads no draft probabilities; only sampling carries them to the next step.
  return (tokens_BxS, caches, jnp.stack(draft_logits, axis=1) if temperature else None,
          num_drafts_B if plan.min_prob else None)


def draft_confidence(logits_BxV, draft_B, temperature: float, top_p: float):
  """What adaptive depth compares with `min_prob`: the top probability of the distribution drafts
  are drawn from (greedy: the draft's own). `draft_B` is deliberately unused: a rule that read the
  drawn draft's probability would make proposing depend on the draw, and sampled output would no
  longer follow plain sampling (the decoding tests catch that rule)."""
  del draft_B
  return jnp.max(sampling.probs(logits_BxV, temperature or 1.0, top_p), axis=-1)


def _choose_draft(model: MTPTransformer, vocab: DraftVocab | None, temperature: float, top_p: float, key,
                  rows: 'DepthRows | None', h_Bx1xD):
  """Each row's draft at this depth and its logits over V (-inf outside a draft vocabulary). A
  tree (`rows`): h holds one row per parent node, which drafts its b_j children (greedy: ranks
  0..b_j-1; sampling: independent draws), and each path's row takes its node's draft and its
  parent's logits."""
  logits_BxU = model.logits(h_Bx1xD, None if vocab is None else vocab.w)[:, 0]
  width = 1 if rows is None else rows.width
  draft_BxW = None
  if not temperature:  # greedy needs only the argmax (or the top b_j) among the U columns
    draft_BxW = jnp.argmax(logits_BxU, axis=-1)[:, None] if rows is None else jax.lax.top_k(logits_BxU, width)[1]
    draft_BxW = draft_BxW if vocab is None else vocab.ids_U[draft_BxW]
  logits_BxV = logits_BxU if vocab is None else jnp.full(  # sampling reads q over V: 0 outside the vocabulary
      logits_BxU.shape[:1] + (model.cfg.vocab_size,), -jnp.inf, logits_BxU.dtype).at[:, vocab.ids_U].set(logits_BxU)
  if draft_BxW is None:
    draft_BxW = sampling.choose(key, jnp.repeat(logits_BxV, width, axis=0), temperature, top_p)
  draft_B = draft_BxW.reshape(-1).astype(jnp.int32)
  return (draft_B, logits_BxV) if rows is None else (draft_B[rows.node_R], logits_BxV[rows.parent_R])


# ---------------------------------------------------------------------------------------------
# Trees: paths, nodes and the rows that draft them


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


# ---------------------------------------------------------------------------------------------
# Trees: one verify pass over the nodes, and the path a step commits


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


def verify_pass(model: MTPTransformer, tokens_RxS, length_R, caches, tree: tuple[int, ...]):
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
