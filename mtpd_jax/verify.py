"""Verifying a step's drafts: one trunk pass over the tree's nodes, the path it commits, and that
path's trunk cache slots moved into place.

Axes: the legend in mtpd_jax/__init__.py. Verifying is one trunk call over each sequence's O nodes
with a tree attention mask (`verify_pass`); `accept` picks the path to commit (greedy: the longest
accepted; sampling: recursive rejection sampling down the tree), and `keep_path` copies that path's
trunk cache slots into place. The nodes and their tables come from drafting.py (`drafting.Tree`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from mtpd_jax import sampling
from mtpd_jax.drafting import DraftPlan, tree_of
from mtpd_jax.model import MTPTransformer



def verify_pass(model: MTPTransformer, nodes_BxNodes, length_B, caches, plan: DraftPlan):
  """One trunk call over each sequence's O nodes: node n of depth j sits at position L+j (L: the
  pending token's) in cache slot L+n, and sees the committed prefix (slots < L) and its own
  ancestors (a chain: the causal mask). Returns (h^0, main logits) of each node, [B, Nodes, ...],
  and the trunk caches with the nodes in slots L..L+O-1 (`keep_path` compacts the winning path)."""
  tree = tree_of(plan)
  n, s = len(tree.depth_Nodes), caches[0]['k'].shape[2]
  pending_B = length_B - 1
  pos_BxNodes = pending_B[:, None] + tree.depth_Nodes
  rel_BxS = jnp.arange(s) - pending_B[:, None]  # slot - L: < 0 the committed prefix, [0, O) the tree
  sees_BxNodesxS = jnp.take(jnp.asarray(tree.ancestor_NodesxNodes), jnp.clip(rel_BxS, 0, n - 1),
                            axis=1).transpose(1, 0, 2)
  mask_BxNodesxS = (rel_BxS < 0)[:, None, :] | (sees_BxNodesxS & (rel_BxS < n)[:, None, :])
  h_BxNodesxD, caches = model.trunk(nodes_BxNodes, pos_BxNodes, mask_BxNodesxS, caches,
                                    pending_B[:, None] + jnp.arange(n))
  return h_BxNodesxD, model.logits(h_BxNodesxD), caches


def accept(key, nodes_BxNodes, draft_logits_BxNodesxV, logits_BxNodesxV, plan: DraftPlan,
           temperature: float, top_p: float = 1.0, proposed_BxNodes=None):
  """(path, a, next) per sequence: the path it commits, the drafts accepted along it and the token
  after them.

  Greedy: every path is verified as a chain against the main argmax at its nodes, drafts that were
  not proposed (adaptive depth, a context draft not found) count as rejected, and the longest
  accepted path wins, the first on ties. Sampling: recursive rejection sampling down the tree
  (SpecInfer, Miao et al. 2024): at the current node, with p the main head's law there and q_c the
  law child c was drawn from (its parent head's, or one-hot for a context draft), a proposed child
  is accepted with probability min(1, p/q_c) under the p that its elder siblings' rejections left,
  each rejection replacing p by the normalised residual max(0, p - q_c); the walk moves to the first
  accepted child, and where none is, the next token is drawn from the current p. Each sibling is a
  speculative-sampling round with target p and a draw from q_c independent of the others, so the
  emitted tokens follow plain sampling exactly (docs/design.md); a chain is Leviathan et al.'s rule.
  """
  tree = tree_of(plan)
  b = nodes_BxNodes.shape[0]
  if not temperature:
    target_BxNodes = jnp.argmax(logits_BxNodesxV, axis=-1).astype(jnp.int32)
    # Each path's draft at depth j+1 against the main argmax at its depth-j node.
    ok_BxPathsxJ = (nodes_BxNodes[:, tree.path_nodes[:, 1:]]
                    == target_BxNodes[:, tree.path_nodes[:, :-1]])
    if proposed_BxNodes is not None:
      ok_BxPathsxJ &= proposed_BxNodes[:, tree.path_nodes[:, 1:]]
    a_BxPaths = jnp.sum(jnp.cumprod(ok_BxPathsxJ, axis=-1), axis=-1).astype(jnp.int32)
    path_B = jnp.argmax(a_BxPaths, axis=1).astype(jnp.int32)
    a_B = jnp.take_along_axis(a_BxPaths, path_B[:, None], axis=1)[:, 0]
    end_B = jnp.asarray(tree.path_nodes)[path_B, a_B]
    return path_B, a_B, jnp.take_along_axis(target_BxNodes, end_B[:, None], axis=1)[:, 0]
  child_depth = np.minimum(tree.depth_Nodes + 1, len(tree.branching))
  first_child_Nodes = jnp.asarray(tree.path_nodes[tree.path_Nodes, child_depth])
  at_node = lambda x_BxNodes, node_B: jnp.take_along_axis(
      x_BxNodes, node_B.reshape(b, 1, *([1] * (x_BxNodes.ndim - 2))), axis=1)[:, 0]
  law = lambda logits_BxV: sampling.probs(logits_BxV, temperature, top_p)
  at = lambda p_BxV, x_B: jnp.take_along_axis(p_BxV, x_B[:, None], axis=1)[:, 0]
  node_B = jnp.zeros((b,), jnp.int32)
  p_BxV, alive_B = law(logits_BxNodesxV[:, 0]), jnp.ones((b,), bool)
  keys = jax.random.split(key, len(tree.branching) + 1)
  for j, width in enumerate(tree.branching):  # try the children, at depth j+1, of each walk's depth-j node
    trying_B, child_B, u_BxChildren = alive_B, node_B, jax.random.uniform(keys[j], (b, width))
    for c in range(width):
      m_B = first_child_Nodes[node_B] + c
      x_B, q_BxV = at_node(nodes_BxNodes, m_B), law(at_node(draft_logits_BxNodesxV, m_B))
      drawn_B = trying_B if proposed_BxNodes is None else trying_B & at_node(proposed_BxNodes, m_B)
      ok_B = drawn_B & sampling.accept_draft(u_BxChildren[:, c], at(p_BxV, x_B), at(q_BxV, x_B))
      child_B = jnp.where(ok_B, m_B, child_B)
      p_BxV = jnp.where((drawn_B & ~ok_B)[:, None], sampling.residual(p_BxV, q_BxV), p_BxV)
      trying_B &= ~ok_B
    alive_B, node_B = child_B != node_B, child_B
    p_BxV = jnp.where(alive_B[:, None], law(at_node(logits_BxNodesxV, node_B)), p_BxV)
  next_B = sampling.categorical(keys[-1], p_BxV)
  return jnp.asarray(tree.path_Nodes)[node_B], jnp.asarray(tree.depth_Nodes)[node_B], next_B


def keep_path(caches, length_B, path_B, plan: DraftPlan):
  """Trunk caches where slots L+1..L+J hold the nodes of each sequence's committed path, as a
  chain's verify call would have written them (a chain's are there already); the other nodes'
  slots lie past the committed tokens, so no query sees them before the next pass rewrites them."""
  tree = tree_of(plan)
  if len(tree.path_nodes) == 1:
    return caches
  pending_B = length_B - 1
  from_BxJ = pending_B[:, None] + jnp.asarray(tree.path_nodes)[path_B, 1:]
  to_BxJ = pending_B[:, None] + jnp.arange(1, len(tree.branching) + 1)
  seq_Bx1 = jnp.arange(len(pending_B))[:, None]
  return [{name: c.at[seq_Bx1, :, to_BxJ].set(c[seq_Bx1, :, from_BxJ], mode='drop') for name, c in cache.items()}
          for cache in caches]
