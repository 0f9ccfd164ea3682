"""Drafting for self-speculative decoding: what a step proposes, and the bookkeeping of a tree.

Dimension letters: the legend in mtpd_jax/__init__.py. A `DraftPlan` says how a speculative step
drafts (docs/design.md, "Decoding cost"):
- a chain of `depth` = J drafts: depth j runs head ((j-1) mod K)+1 (training-free looping, MTP-D*
  of Table 8, past K) on the depth j-1 hidden states and the token j ahead (`draft`);
- a static `tree` of branching (b_1, ..., b_J): P = Π b_j root-to-leaf paths, whose drafts are
  verified together in one tree attention pass of the trunk (`verify.verify_pass`);
- adaptive depth (`min_prob`): a sequence proposes only its leading drafts whose head put at least
  that on its most likely token, a choice made before any draw, so sampling stays lossless;
- a draft vocabulary (`vocab`): drafts are chosen among those token ids only (a head vocabulary,
  or the most frequent training tokens); verification keeps the main head over all of V;
- drafts from the context (`source`): 'context' drafts the chain by prompt lookup, no heads at all
  (`lookup.context_drafts`: what followed an earlier occurrence of the sequence's last n-gram);
  'both' verifies the heads' chain and the context's chain together, as the two paths of the tree
  (2, 1, ..., 1) (docs/design.md, "Drafts from the context").

`decode.py` owns the loop (state, commit, prefill, step) and calls `draft` after each verify
(verify.py: the tree pass, the accepted path, its cache slots); this file takes arrays and the plan
and never imports decode.

Trees. Node n of depth j is the token of rank r (0 = argmax; sampling: the r-th of b_j independent
draws) of the depth-j draft logits at its parent, which are the head's logits on the node's own
ancestors (the chain's semantics). A tree has O = `num_nodes` nodes, the pending token and the
drafts; its P = Π b_j root-to-leaf paths exist only as index tables (`Tree`). The state keeps one
row per sequence, and the head of depth j runs once per node of depth j-1, so drafting costs what
the nodes cost, not the paths. Depth j's head cache has one row per node of depth j-1 and needs no
copy: the next draft pass rewrites every slot that was not final.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtpd_jax import lookup, sampling
from mtpd_jax.model import MTPTransformer, cache_mask
from mtpd_jax.shifts import gather_at


# ---------------------------------------------------------------------------------------------
# The plan


SOURCES = ('heads', 'context', 'both')


@dataclasses.dataclass(frozen=True)
class DraftPlan:
  """How a speculative step drafts; `DraftPlan()` (depth 0) is plain decoding. Static: one
  compilation per distinct plan."""
  depth: int = 0                  # J drafts per step; past K the heads loop
  tree: tuple[int, ...] = ()      # branching per depth, one per draft depth; () = a chain
  min_prob: float = 0.0           # adaptive depth: stop drafting below this top probability (0 = always J)
  vocab: tuple[int, ...] = ()     # token ids that drafts are chosen among; () = all of V
  source: str = 'heads'           # 'heads', 'context' (prompt lookup) or 'both' (the two chains as one tree)
  ngram: int = 3                  # context drafts: the longest suffix n-gram looked up (down to 1)

  def __post_init__(self):
    object.__setattr__(self, 'tree', tuple(int(b) for b in self.tree))
    object.__setattr__(self, 'vocab', tuple(int(i) for i in self.vocab))
    object.__setattr__(self, 'min_prob', float(self.min_prob) if self.depth else 0.0)
    object.__setattr__(self, 'source', self.source if self.depth else 'heads')
    if self.depth < 0:
      raise ValueError(f'draft depth {self.depth} must be >= 0 (0 = plain decoding)')
    if not 0.0 <= self.min_prob <= 1.0:
      raise ValueError(f'draft_min_prob={self.min_prob} must lie in [0, 1]')
    check(self.tree, self.depth)
    if self.source not in SOURCES:
      raise ValueError(f'draft source {self.source!r} must be one of {SOURCES}')
    if self.source != 'heads' and self.tree:
      raise ValueError(f"draft_source={self.source!r} drafts chains; a tree ({self.tree}) drafts from the heads only")
    if self.source == 'context' and self.min_prob:
      raise ValueError("draft_source='context' has no head probabilities for draft_min_prob to cut at")
    if self.ngram < 1:
      raise ValueError(f'ngram={self.ngram} must be >= 1')
    if self.vocab and (min(self.vocab) < 0 or len(set(self.vocab)) != len(self.vocab)):
      raise ValueError('draft vocabulary ids must be distinct and >= 0')

  @property
  def paths(self) -> int:
    return len(tree_of(self).path_nodes)

  @property
  def verified(self) -> int:
    """Positions one verify call writes: the pending token and the drafts (a tree's O nodes)."""
    return len(tree_of(self).depth_Nodes)

  def check_vocab(self, vocab_size: int) -> None:
    if self.vocab and max(self.vocab) >= vocab_size:
      raise ValueError(f'draft vocabulary ids must be distinct and in [0, {vocab_size})')


def vocab_ids(ids) -> tuple[int, ...]:
  """A draft vocabulary's ids as a tuple; anything but a non-empty 1-D integer array raises ValueError."""
  ids = np.asarray(ids)
  if ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f'a draft vocabulary is a non-empty 1-D array of token ids, got shape {ids.shape} {ids.dtype}')
  return tuple(ids.tolist())


def head_for_depth(j: int, num_mtp_heads: int) -> int:
  """The MTP head (1-based) that drafts at depth j: ((j-1) mod K)+1."""
  return (j - 1) % num_mtp_heads + 1


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
# The tree: nodes, paths and the tables that index them


class Tree(NamedTuple):
  """The static tables of a plan's tree (a chain is the tree (1, ..., 1)). Nodes are numbered depth
  by depth: node 0 is the root (the pending token), then the nodes of depth 1, 2, ..., each depth in
  lexicographic order of the ranks that lead to it, so node k's children at the next depth are
  k·b + 0..b-1 among that depth's nodes."""
  branching: tuple[int, ...]
  path_nodes: np.ndarray   # [P, J+1]: the node path p passes at depth j
  depth_Nodes: np.ndarray  # each node's depth
  path_Nodes: np.ndarray   # the first path through each node
  # Node m is n or an ancestor of n: what n sees in the tree attention pass.
  ancestor_NodesxNodes: np.ndarray
  starts: np.ndarray       # [J+1]: each depth's first node
  sizes: tuple[int, ...]   # [J+1]: the nodes at each depth


@functools.lru_cache(maxsize=64)
def tree_tables(branching: tuple[int, ...]) -> Tree:
  paths, sizes = math.prod(branching), tuple(math.prod(branching[:j]) for j in range(len(branching) + 1))
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
  below_J1 = paths // np.array(sizes)  # paths under one node of each depth
  path_nodes = (starts[None, :] + np.arange(paths)[:, None] // below_J1[None, :]).astype(np.int32)
  n = int(sum(sizes))
  depth_Nodes, path_Nodes = np.zeros(n, np.int32), np.zeros(n, np.int32)
  ancestor_NodesxNodes = np.zeros((n, n), bool)
  for p in reversed(range(paths)):  # reversed: the first path through a node writes last
    for j, node in enumerate(path_nodes[p]):
      depth_Nodes[node], path_Nodes[node] = j, p
      ancestor_NodesxNodes[node, path_nodes[p, :j + 1]] = True
  return Tree(tuple(branching), path_nodes, depth_Nodes, path_Nodes, ancestor_NodesxNodes, starts,
              sizes)


def tree_of(plan: DraftPlan) -> Tree:
  """The plan's tree: its `tree`, or the chain (1, ..., 1) of its depth; with `source='both'` the
  tree (2, 1, ..., 1), whose path 0 the heads draft and path 1 the context (`draft`)."""
  if plan.source == 'both':
    return tree_tables((2,) + (1,) * (plan.depth - 1))
  return tree_tables(plan.tree or (1,) * plan.depth)


def check(tree: tuple[int, ...], draft_depth: int) -> None:
  """Refuse a tree that decoding cannot run, in one line."""
  if tree and (len(tree) != draft_depth or any(b < 1 for b in tree)):
    raise ValueError(f'tree={tree} must give a branching >= 1 for each of the draft_depth={draft_depth} depths')


def num_paths(tree: tuple[int, ...]) -> int:
  """P: root-to-leaf paths of the tree (1 for a chain)."""
  return math.prod(tree) if tree else 1


def num_nodes(tree: tuple[int, ...]) -> int:
  """O: the root and every distinct draft of the tree, the tokens one tree attention pass verifies."""
  return 1 + int(np.cumprod(tree).sum())


def path_nodes(tree: tuple[int, ...]) -> np.ndarray:
  """[P, J+1]: the tree node that path p passes at depth j = 0..J (`Tree`)."""
  return tree_tables(tuple(tree)).path_nodes


# ---------------------------------------------------------------------------------------------
# Drafting: one row per sequence, and per node the head passes of a tree


def draft(model: MTPTransformer, plan: DraftPlan, tokens_BxS, length_B, h0_BxSxD, head_caches, start_B,
          width: int, key, vocab: DraftVocab | None, temperature: float, top_p: float):
  """Re-run depths 1..J over positions [start, start+width) and draft the tree's nodes after the
  pending token L (a chain's drafts L+1..L+J).

  Depth j at window position i reads h^{j-1}_i and token i+j, and predicts token i+j+1; the window
  covers every head-cache slot that was not final after the previous pass (decode.py's cache
  scheme). Depth j runs once per node of depth j-1 (B·N_{j-1} rows, b-major): its window's tokens
  are the committed ones, then the node's own ancestors' drafts at L+1..L+j-1, and the node's b_j
  children are its logits' top b_j (sampling: b_j independent draws). Context drafts replace the
  heads' (`source='context'`, no head runs) or their path 1 (`source='both'`). Returns
  (nodes_BxNodes: the pending token, then the drafts; the head caches; with sampling the logits
  each node was drawn from, [B, Nodes, V] (the root: zeros), else None; with adaptive depth or
  context drafts whether each node is a proposed draft, [B, Nodes], else None).
  """
  tree = tree_of(plan)
  b, s = tokens_BxS.shape
  pending_B = length_B - 1
  pending_tokens_B = gather_at(tokens_BxS, pending_B[:, None])[:, 0]
  nodes_BxNodes = jnp.zeros((b, len(tree.depth_Nodes)), jnp.int32).at[:, 0].set(pending_tokens_B)
  # Adaptive depth: every ancestor confident; context: found.
  proposed_BxNodes = jnp.ones(nodes_BxNodes.shape, bool)
  context = plan.source != 'heads'
  if context:  # path 1 of 'both' (node starts[j] + 1 at depth j), or the whole chain
    ctx_BxJ, found_BxJ = lookup.context_drafts(tokens_BxS, length_B, plan.depth, plan.ngram)
    ctx_J = tree.path_nodes[-1, 1:]
  if plan.source == 'context':
    nodes_BxNodes = nodes_BxNodes.at[:, ctx_J].set(ctx_BxJ)
    proposed_BxNodes = proposed_BxNodes.at[:, ctx_J].set(found_BxJ)
    laws = _one_hot_laws(nodes_BxNodes, model.cfg.vocab_size) if temperature else None
    return nodes_BxNodes, head_caches, laws, proposed_BxNodes
  pos_BxWindow = start_B[:, None] + jnp.arange(width)
  mask_BxWindowxS = cache_mask(pos_BxWindow, s)
  last_Bx1 = (pending_B - 1 - start_B)[:, None]  # window index of the last trunk position L-1
  h_ParentsxWindowxD = gather_at(h0_BxSxD, pos_BxWindow)
  caches, draft_logits = [], [jnp.zeros((b, 1, model.cfg.vocab_size), jnp.float32)]
  for j, key_j in zip(range(1, plan.depth + 1), jax.random.split(key, plan.depth)):
    n, width_j, first = tree.sizes[j - 1], tree.branching[j - 1], int(tree.starts[j - 1])
    children = slice(int(tree.starts[j]), int(tree.starts[j]) + n * width_j)
    each = lambda x: jnp.repeat(x, n, axis=0)  # a sequence's rows, one per node of depth j-1
    if j > 1:  # the parent's depth-(j-1) states, one copy per child
      h_ParentsxWindowxD = jnp.repeat(h_ParentsxWindowxD, tree.branching[j - 2], axis=0)
    tokens_ParentsxWindow = each(gather_at(tokens_BxS, pos_BxWindow + j))
    node_ids = first + np.arange(n)
    for d in range(1, j):  # positions past the pending token hold the node's ancestors' drafts
      anc_Parents = nodes_BxNodes[:, tree.path_nodes[tree.path_Nodes[node_ids], d]].reshape(-1)
      at_d = each(pos_BxWindow + j) == each(pending_B + d)[:, None]
      tokens_ParentsxWindow = jnp.where(at_d, anc_Parents[:, None], tokens_ParentsxWindow)
    h_ParentsxWindowxD, cache = model.mtp_head(
        head_for_depth(j, model.cfg.num_mtp_heads), h_ParentsxWindowxD, tokens_ParentsxWindow,
        each(pos_BxWindow), each(mask_BxWindowxS), head_caches[j - 1])
    h_Parentsx1xD = gather_at(h_ParentsxWindowxD, each(last_Bx1))
    choose = functools.partial(_choose_draft, model, vocab, temperature, top_p, key_j, width_j)
    # Adaptive depth: a node drafts children only if it is proposed itself.
    up_BxParents = proposed_BxNodes[:, node_ids]
    if plan.min_prob and j > 1:  # skip the logits once no node drafts this deep
      skip = lambda _: (jnp.zeros((b * n, width_j), jnp.int32), jnp.zeros((b * n, model.cfg.vocab_size)))
      drafts_ParentsxChildren, logits_ParentsxV = jax.lax.cond(jnp.any(up_BxParents), choose, skip,
                                                               h_Parentsx1xD)
    else:
      drafts_ParentsxChildren, logits_ParentsxV = choose(h_Parentsx1xD)
    if plan.min_prob:  # a node's children are proposed if it is and its own head is confident
      confidence = draft_confidence(logits_ParentsxV, drafts_ParentsxChildren, temperature, top_p)
      confident_BxParents = confidence.reshape(b, n) >= plan.min_prob
      proposed_BxNodes = proposed_BxNodes.at[:, children].set(
          jnp.repeat(up_BxParents & confident_BxParents, width_j, axis=1))
    nodes_BxNodes = nodes_BxNodes.at[:, children].set(drafts_ParentsxChildren.reshape(b, -1))
    if temperature:  # each child's q: its parent's law
      draft_logits.append(jnp.repeat(logits_ParentsxV.reshape(b, n, -1), width_j, axis=1))
    if context:  # path 1's node at this depth: the context's draft, proposed where a match reaches it
      nodes_BxNodes = nodes_BxNodes.at[:, ctx_J[j - 1]].set(ctx_BxJ[:, j - 1])
      proposed_BxNodes = proposed_BxNodes.at[:, ctx_J[j - 1]].set(found_BxJ[:, j - 1])
    caches.append(cache)
  # Greedy verification reads no draft probabilities; only sampling carries them to the next step.
  draft_logits_BxNodesxV = None
  if temperature:
    draft_logits_BxNodesxV = jnp.concatenate(draft_logits, axis=1)
    if context:
      laws = _one_hot_laws(nodes_BxNodes, model.cfg.vocab_size)
      draft_logits_BxNodesxV = draft_logits_BxNodesxV.at[:, ctx_J].set(laws[:, ctx_J])
  proposed = proposed_BxNodes if plan.min_prob or context else None
  return nodes_BxNodes, caches, draft_logits_BxNodesxV, proposed


def _one_hot_laws(nodes_BxNodes, vocab_size: int):
  """Logits whose law puts all mass on each node's token: the q of a draft that is not drawn."""
  return jnp.where(jnp.arange(vocab_size) == nodes_BxNodes[..., None], 0.0, -jnp.inf)


def draft_confidence(logits_BxV, drafts_BxChildren, temperature: float, top_p: float):
  """What adaptive depth compares with `min_prob`: the top probability of the distribution drafts
  are drawn from (greedy: the first draft's own). `drafts_BxChildren` is deliberately unused: a
  rule that read a drawn draft's probability would make proposing depend on the draw, and sampled
  output would no longer follow plain sampling (the decoding tests catch that rule)."""
  del drafts_BxChildren
  return jnp.max(sampling.probs(logits_BxV, temperature or 1.0, top_p), axis=-1)


def _choose_draft(model: MTPTransformer, vocab: DraftVocab | None, temperature: float, top_p: float, key,
                  width: int, h_Parentsx1xD):
  """Each node's `width` children at this depth (greedy: its logits' ranks 0..width-1; sampling:
  independent draws), and its logits over V (-inf outside a draft vocabulary)."""
  logits_ParentsxU = model.logits(h_Parentsx1xD, None if vocab is None else vocab.w)[:, 0]
  drafts_ParentsxChildren = None
  if not temperature:  # greedy needs only the argmax (or the top b_j) among the U columns
    drafts_ParentsxChildren = (jnp.argmax(logits_ParentsxU, axis=-1)[:, None] if width == 1
                               else jax.lax.top_k(logits_ParentsxU, width)[1])
    drafts_ParentsxChildren = (drafts_ParentsxChildren if vocab is None
                               else vocab.ids_U[drafts_ParentsxChildren])
  logits_ParentsxV = logits_ParentsxU
  if vocab is not None:  # sampling reads q over V: 0 outside the vocabulary
    logits_ParentsxV = jnp.full(logits_ParentsxU.shape[:1] + (model.cfg.vocab_size,), -jnp.inf,
                                logits_ParentsxU.dtype).at[:, vocab.ids_U].set(logits_ParentsxU)
  if drafts_ParentsxChildren is None:
    drafts_ParentsxChildren = sampling.choose(key, jnp.repeat(logits_ParentsxV, width, axis=0),
                                              temperature, top_p).reshape(-1, width)
  return drafts_ParentsxChildren.astype(jnp.int32), logits_ParentsxV
