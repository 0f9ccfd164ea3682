"""Mixture-of-Experts feed-forward: a top-k router, capacity or dropless dispatch, load balancing.

Axes: the legend in mtpd_jax/__init__.py. Its words Experts, Chosen (per token), Groups (of R
tokens each) and Slots (of an expert's capacity) are x, a, y and c in the einsums, and X, A, Y and C
in the formulas below.

Router (DeepSeek-style): softmax over the X experts in f32, the top A chosen, and their gates
renormalised to sum to 1 (`renormalize_gates`). Balancing, either or both:
  * auxiliary loss (Switch/GShard): X · Σ_x f_x · P_x, with f_x the share of routed choices that
    pick expert x and P_x its mean router probability; 1 when even. Weighted by `aux_loss_weight`.
  * bias (DeepSeek-V3 "aux-loss-free"): a per-expert bias added to the scores for *choosing* only
    (gates come from the unbiased probabilities); after each step it moves by `bias_update_rate`
    toward even load: b_x += rate · sign(1/X − f_x). It is a `RouterBias` parameter with zero
    gradient: the training forward moves it (`move_bias`) and train_step keeps the moved value,
    selecting the biases by that type, never by their paths.
Dispatch:
  * capacity (`capacity_factor` > 0), used by the training forward: each sequence is cut into
    groups of R tokens (`group_size`, 0 = the whole sequence); expert x takes at most
    C = ceil(capacity_factor · R · A / X) choices per group, in token order (token-major, so a
    token's slot depends only on earlier tokens: the trunk stays causal). A choice over capacity is
    dropped: its share of the token's output is zero and the token passes through the residual.
    The dispatch is a one-hot einsum into an [X, Y, C, D] buffer, which shards over experts.
  * dropless: every token reaches all its A experts. Computed densely (every expert on every
    token, weighted by the gates; X/A times the expert FLOPs), so it suits decoding and small
    models. The inference entry points (`trunk`, `mtp_head`) are always dropless, so a token's
    output never depends on which other tokens share its call and speculative verification
    equals plain decoding.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Routed experts of each block's feed-forward; `num_experts=0` is the dense SwiGLU MLP."""
  num_experts: int = 0            # X routed experts; 0 = dense
  top_k: int = 2                  # A experts per token
  expert_dim: int = 0             # F of each expert (and of each shared expert); 0 = model.mlp_dim
  num_shared_experts: int = 0     # experts every token passes through (one SwiGLU of width s·F)
  capacity_factor: float = 1.25   # training forward: slots per expert = factor·R·A/X; <= 0 = dropless
  group_size: int = 0             # R, tokens per routing group; 0 = the whole sequence
  renormalize_gates: bool = True  # top-k gates sum to 1 (DeepSeek); False = raw softmax probabilities
  aux_loss_weight: float = 0.01   # Switch-style balancing loss weight (0 = off)
  bias_update_rate: float = 0.0   # DeepSeek-V3 balancing bias step per train step (0 = off)

  def __post_init__(self):
    if self.num_experts < 0 or self.num_shared_experts < 0 or self.group_size < 0 or self.expert_dim < 0:
      raise ValueError(f'model.moe: num_experts, num_shared_experts, group_size and expert_dim must be >= 0 '
                       f'({self})')
    if self.num_experts and not 1 <= self.top_k <= self.num_experts:
      raise ValueError(f'model.moe.top_k={self.top_k} must lie in 1..num_experts={self.num_experts}')
    if self.aux_loss_weight < 0 or self.bias_update_rate < 0:
      raise ValueError(f'model.moe.aux_loss_weight={self.aux_loss_weight} and bias_update_rate='
                       f'{self.bias_update_rate} must be >= 0')

  def capacity(self, group_tokens: int) -> int:
    """C: slots per expert in a group of `group_tokens` (never more than the group holds)."""
    c = math.ceil(self.capacity_factor * group_tokens * self.top_k / self.num_experts)
    return max(1, min(c, group_tokens))


_expert_init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal', in_axis=1, out_axis=2,
                                                 batch_axis=(0,))


class RouterBias(nnx.Param):
  """A router's balancing bias (DeepSeek-V3): chooses experts, gets no gradient, moved by the forward."""


def param(rngs, init, shape, axes, kind=nnx.Param) -> nnx.Param:
  """A float32 parameter (of `kind`) that carries its logical axis names, mapped to the mesh by
  sharding.py; `rngs` is anything with a `params()` key stream (model.py's keys too)."""
  return kind(init(rngs.params(), shape, jnp.float32), axes=axes)


def route(logits_RxExperts, bias_Experts, top_k: int, renormalize: bool):
  """Top-k experts of each token and their gates (from the unbiased softmax, in f32)."""
  probs_RxExperts = jax.nn.softmax(logits_RxExperts.astype(jnp.float32), axis=-1)
  # The bias moves the choice only: gates come from the unbiased probabilities.
  _, idx_RxChosen = jax.lax.top_k(probs_RxExperts + jax.lax.stop_gradient(bias_Experts), top_k)
  gates_RxChosen = jnp.take_along_axis(probs_RxExperts, idx_RxChosen, axis=-1)
  if renormalize:
    gates_RxChosen = gates_RxChosen / jnp.sum(gates_RxChosen, axis=-1, keepdims=True)
  return idx_RxChosen, gates_RxChosen, probs_RxExperts


def dispatch_masks(idx_GroupsxRxChosen, gates_GroupsxRxChosen, valid_GroupsxR, num_experts: int,
                   capacity: int):
  """One-hot dispatch and gate-weighted combine tensors (Groups x R x Experts x Slots), and which
  choices fit (Groups x R x Chosen).

  Slots are handed out in token-major order (all choices of token r before token r+1), so a
  token's placement depends only on earlier tokens of its group. Invalid (padding) tokens take none.
  """
  y, r, a = idx_GroupsxRxChosen.shape
  choice_GroupsxRxChosenxExperts = (jax.nn.one_hot(idx_GroupsxRxChosen, num_experts, dtype=jnp.int32)
                                    * valid_GroupsxR[..., None, None])
  # An expert's queue position for each choice: its earlier choices in the group, token-major.
  queue = jnp.cumsum(choice_GroupsxRxChosenxExperts.reshape(y, r * a, num_experts), axis=1) - 1
  slot_GroupsxRxChosen = jnp.sum(queue.reshape(y, r, a, num_experts)
                                 * choice_GroupsxRxChosenxExperts, axis=-1)
  # A valid token's choice (padding tokens choose nothing).
  chose_GroupsxRxChosen = jnp.sum(choice_GroupsxRxChosenxExperts, axis=-1) > 0
  keep_GroupsxRxChosen = (slot_GroupsxRxChosen < capacity) & chose_GroupsxRxChosen
  slot_GroupsxRxChosenxSlots = (jax.nn.one_hot(slot_GroupsxRxChosen, capacity, dtype=jnp.float32)
                                * keep_GroupsxRxChosen[..., None])
  choice_GroupsxRxChosenxExperts = choice_GroupsxRxChosenxExperts.astype(jnp.float32)
  dispatch_GroupsxRxExpertsxSlots = jnp.einsum('yrax,yrac->yrxc', choice_GroupsxRxChosenxExperts,
                                               slot_GroupsxRxChosenxSlots)
  combine_GroupsxRxExpertsxSlots = jnp.einsum('yrax,yrac,yra->yrxc', choice_GroupsxRxChosenxExperts,
                                              slot_GroupsxRxChosenxSlots, gates_GroupsxRxChosen)
  return dispatch_GroupsxRxExpertsxSlots, combine_GroupsxRxExpertsxSlots, keep_GroupsxRxChosen


def routing_stats(idx_RxChosen, probs_RxExperts, keep_RxChosen, valid_R,
                  bias_update_rate: float) -> dict:
  """Balancing loss, per-expert load f_x (share of routed choices, before capacity) and drops."""
  x = probs_RxExperts.shape[-1]
  n_valid = jnp.maximum(jnp.sum(valid_R), 1)
  choice_RxExperts = jnp.sum(jax.nn.one_hot(idx_RxChosen, x), axis=1) * valid_R[:, None]
  load_Experts = jnp.sum(choice_RxExperts, axis=0) / (n_valid * idx_RxChosen.shape[-1])
  mean_prob_Experts = jnp.sum(probs_RxExperts * valid_R[:, None], axis=0) / n_valid
  return {'aux_loss': x * jnp.sum(jax.lax.stop_gradient(load_Experts) * mean_prob_Experts),
          'max_load': x * jnp.max(load_Experts),
          'dropped_frac': (1.0 - jnp.sum(keep_RxChosen * valid_R[:, None])
                           / (n_valid * idx_RxChosen.shape[-1])),
          'bias_delta_Experts': bias_update_rate * jnp.sign(1.0 / x - load_Experts)}


class MoE(nnx.Module):
  """X SwiGLU experts of width F behind a top-A router (shared experts live in the Block)."""

  def __init__(self, dim: int, cfg: MoEConfig, rngs: nnx.Rngs):
    x, f = cfg.num_experts, cfg.expert_dim
    self.cfg = cfg
    self.w_router = param(rngs, nnx.initializers.normal(0.02), (dim, x), ('embed', None))
    self.router_bias = param(rngs, nnx.initializers.zeros, (x,), (None,), RouterBias)
    self.w_gate = param(rngs, _expert_init, (x, dim, f), ('expert', 'embed', 'mlp'))
    self.w_up = param(rngs, _expert_init, (x, dim, f), ('expert', 'embed', 'mlp'))
    self.w_down = param(rngs, _expert_init, (x, f, dim), ('expert', 'mlp', 'embed'))

  def _experts(self, x_ExpertsxGroupsxSlotsxD):
    dt = x_ExpertsxGroupsxSlotsxD.dtype
    gate = jnp.einsum('xycd,xdf->xycf', x_ExpertsxGroupsxSlotsxD, self.w_gate[...].astype(dt))
    up = jnp.einsum('xycd,xdf->xycf', x_ExpertsxGroupsxSlotsxD, self.w_up[...].astype(dt))
    return jnp.einsum('xycf,xfd->xycd', jax.nn.silu(gate) * up, self.w_down[...].astype(dt))

  def __call__(self, x_BxTxD, *, dropless: bool = True, move_bias: bool = False):
    """(output BxTxD, routing stats); `dropless=False` applies the capacity limit (training).

    `move_bias` (the train step's forward) then moves `router_bias` by its balancing step, after
    routing with the old value, as BatchNorm's training forward moves its statistics.
    """
    cfg, dt = self.cfg, x_BxTxD.dtype
    b, t, d = x_BxTxD.shape
    logits_BxTxExperts = jnp.einsum('btd,dx->btx', x_BxTxD.astype(jnp.float32), self.w_router[...])
    idx_BxTxChosen, gates_BxTxChosen, probs_BxTxExperts = route(
        logits_BxTxExperts, self.router_bias[...], cfg.top_k, cfg.renormalize_gates)
    if dropless or cfg.capacity_factor <= 0:
      gates_BxTxExperts = jnp.sum(
          jax.nn.one_hot(idx_BxTxChosen, cfg.num_experts) * gates_BxTxChosen[..., None], axis=2)
      y_ExpertsxBxTxD = self._experts(jnp.broadcast_to(x_BxTxD, (cfg.num_experts, b, t, d)))
      out_BxTxD = jnp.einsum('btx,xbtd->btd', gates_BxTxExperts.astype(dt), y_ExpertsxBxTxD)
      keep_BxTxChosen, valid_BxT = jnp.ones(idx_BxTxChosen.shape, bool), jnp.ones((b, t), bool)
    else:
      # Groups of R consecutive tokens of one sequence; a ragged tail is padded and routes nowhere.
      r = min(cfg.group_size or t, t)
      pad = -t % r
      padded = lambda a, v: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=v)
      y = b * (t + pad) // r
      valid_BxT = padded(jnp.ones((b, t), bool), False)
      masks = dispatch_masks(padded(idx_BxTxChosen, 0).reshape(y, r, -1),
                             padded(gates_BxTxChosen, 0.0).reshape(y, r, -1),
                             valid_BxT.reshape(y, r), cfg.num_experts, cfg.capacity(r))
      dispatch_GroupsxRxExpertsxSlots, combine_GroupsxRxExpertsxSlots, keep_GroupsxRxChosen = masks
      x_GroupsxRxD = padded(x_BxTxD, 0.0).reshape(y, r, d)
      # expert inputs[Experts_expert, Groups_batch, Slots, D]: the dispatch is an all-to-all when
      # both axes are sharded
      dispatch = dispatch_GroupsxRxExpertsxSlots.astype(dt)
      x_ExpertsxGroupsxSlotsxD = jnp.einsum('yrxc,yrd->xycd', dispatch, x_GroupsxRxD)
      out_GroupsxRxD = jnp.einsum('yrxc,xycd->yrd', combine_GroupsxRxExpertsxSlots.astype(dt),
                                  self._experts(x_ExpertsxGroupsxSlotsxD))
      out_BxTxD = out_GroupsxRxD.reshape(b, t + pad, d)[:, :t]
      keep_BxTxChosen = keep_GroupsxRxChosen.reshape(b, t + pad, -1)[:, :t]
      valid_BxT = valid_BxT[:, :t]
    rows = b * t
    stats = routing_stats(idx_BxTxChosen.reshape(rows, -1), probs_BxTxExperts.reshape(rows, -1),
                          keep_BxTxChosen.reshape(rows, -1), valid_BxT.reshape(rows),
                          cfg.bias_update_rate)
    if move_bias and cfg.bias_update_rate:
      self.router_bias[...] = self.router_bias[...] + stats['bias_delta_Experts']
    return out_BxTxD, stats


# ---------------------------------------------------------------------------------------------
# Training-side helpers: the model's routing terms into the loss and metrics, and the moved biases.


def summarize(stats: list[dict], cfg: MoEConfig) -> dict:
  """The model's `aux` output from its MoE layers' stats.

  `loss`: the weighted balancing loss to add to the training loss; `metrics`: its unweighted
  mean over layers (`moe/aux_loss`), the busiest expert's load relative to even (`moe/max_load`,
  1 = balanced) and the share of routed choices dropped by capacity (`moe/dropped_frac`), both
  averaged over layers.
  """
  mean = lambda key: jnp.mean(jnp.stack([s[key] for s in stats]))
  return {'loss': cfg.aux_loss_weight * mean('aux_loss'),
          'metrics': {'moe/aux_loss': mean('aux_loss'), 'moe/max_load': mean('max_load'),
                      'moe/dropped_frac': mean('dropped_frac')}}


def add_router_terms(loss, metrics: dict, aux: dict | None):
  """(loss + balancing loss, metrics + moe/* metrics); `train/loss` stays the MTP-D loss alone."""
  if not aux:
    return loss, metrics
  return loss + aux['loss'], {**metrics, **aux['metrics']}


def keep_moved_biases(updated: nnx.State, before: nnx.State, moved: nnx.State, labels) -> nnx.State:
  """`updated` (the optimizer's result) plus each trainable router bias's step in the forward.

  `moved` holds the `RouterBias` values after a `move_bias` forward from `before`.
  """
  if not jax.tree.leaves(moved):
    return updated
  pick = lambda tree: nnx.filter_state(tree, RouterBias)
  step = lambda new, old, upd, label: upd + (new - old) if label == 'train' else upd
  return nnx.merge_state(updated, jax.tree.map(step, moved, pick(before), pick(updated), pick(labels)))
