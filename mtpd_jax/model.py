"""Llama-style decoder with K DeepSeek-V3-style multi-token-prediction (MTP) heads, in Flax NNX.

Dimension letters (suffixes, einsum letters): the legend in mtpd_jax/__init__.py.

Alignment: the main head at position i predicts token i+1; MTP head k (1-based) at position i
reads the hidden state h^{k-1}_i and the embedding of token i+k, and predicts token i+k+1.

Every method is a pure function of its arguments (KV caches are passed in and returned), so the
same module serves training (`__call__`) and cached decoding (`trunk`, `mtp_head`, `logits`).
With `moe.num_experts > 0` every block's feed-forward (trunk and MTP heads) is a Mixture of
Experts (moe.py); `__call__` applies its capacity limit, `trunk` and `mtp_head` are dropless.

Products with the weight matrices of attention, the MLP, the MTP projection and the output head
go through `out_major.dense`, so decoding on CPU can store them out-major (out_major.py).
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mtpd_jax.moe import MoE, MoEConfig, param, summarize
from mtpd_jax.out_major import dense
from mtpd_jax.rope import rope
from mtpd_jax.shifts import shift_left

# One attention layer's {'k': BxGxSxE, 'v': BxGxSxE}: kv heads before slots, the layout both attention
# dots read directly, so a decoding step transposes no cache (docs/design.md, decoding cost).
Cache = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of the trunk and its MTP heads (Table 3 of the paper names the knobs)."""
  vocab_size: int = 8192
  dim: int = 256
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  mlp_dim: int = 768
  num_mtp_heads: int = 1          # K; 0 is a plain language model
  rope_base: float = 10_000.0
  rope_interleaved: bool = False  # pairs (2j, 2j+1) as in GGUF exports; else rotate_half halves
  rope_scaling: tuple[float, ...] = ()  # Llama 3's (factor, low_freq_factor, high_freq_factor, context); () = none
  qk_norm: bool = True
  attn_bias: bool = False         # q, k and v projections with biases (Qwen2)
  tie_embeddings: bool = False
  norm_eps: float = 1e-6
  max_seq_len: int = 2048
  dtype: str = 'float32'          # compute dtype; params stay f32, softmax and losses f32
  remat: bool = False             # rematerialise each block in the backward pass
  moe: MoEConfig = MoEConfig()    # feed-forward experts; the default (0 experts) is the dense MLP

  def __post_init__(self):
    object.__setattr__(self, 'rope_scaling', tuple(float(x) for x in self.rope_scaling))
    if self.rope_scaling and len(self.rope_scaling) != 4:
      raise ValueError(f'rope_scaling={self.rope_scaling}: expected (factor, low_freq_factor, high_freq_factor, '
                       'original context) or ()')
    if self.moe.num_experts and not self.moe.expert_dim:  # 0 = experts as wide as the dense MLP
      object.__setattr__(self, 'moe', dataclasses.replace(self.moe, expert_dim=self.mlp_dim))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}')
    if self.head_dim % 2:
      raise ValueError(f'head_dim={self.head_dim} must be even for RoPE')
    if self.num_mtp_heads < 0:
      raise ValueError(f'num_mtp_heads={self.num_mtp_heads} must be >= 0')


class ParamKeys:
  """`rngs.params()` for building one model: the same keys, with one count update at the end.

  nnx's stream gives fold_in(key, count) and then adds 1 to its count; this gives fold_in(key,
  count + i) for the i-th parameter and writes count + n back once in `close`. Under tracing
  (`nnx.eval_shape`, a jitted init) every count update costs time linear in the trace so far, which
  made building a deep model's abstract state slow (docs/design.md, "Model construction").
  """

  def __init__(self, rngs: nnx.Rngs):
    self._stream = rngs.params
    self._key, self._count, self._n = self._stream.key[...], self._stream.count[...], 0

  def params(self) -> jax.Array:
    key = jax.random.fold_in(self._key, self._count + self._n)
    self._n += 1
    return key

  def close(self) -> None:
    self._stream.count[...] = self._count + self._n


_dense_init = nnx.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')


def _dense_init_in_axes(*in_axes):
  return nnx.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal', in_axis=in_axes,
                                           out_axis=-1)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, rngs: nnx.Rngs):
    self.scale = param(rngs, nnx.initializers.ones, (dim,), ('norm',))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


def attention_mask(positions_BxT, segment_ids_BxT=None):
  """Training mask BxTxS: causal and, for packed sequences, within one document."""
  mask_BxTxS = positions_BxT[:, None, :] <= positions_BxT[:, :, None]
  if segment_ids_BxT is not None:
    mask_BxTxS &= segment_ids_BxT[:, None, :] == segment_ids_BxT[:, :, None]
  return mask_BxTxS


def cache_mask(positions_BxT, cache_len: int):
  """Decoding mask BxTxS over a cache of `cache_len` slots: key slot s is visible iff s <= query position.

  Slots past a sequence's current length hold stale drafts or padding; they are never visible
  because every call writes the slots of all positions it queries before attending.
  """
  return jnp.arange(cache_len)[None, None, :] <= positions_BxT[:, :, None]


def init_cache(cfg: ModelConfig, batch: int, cache_len: int, num_layers: int) -> list[Cache]:
  """Zeroed KV caches for `num_layers` attention layers."""
  shape = (batch, cfg.num_kv_heads, cache_len, cfg.head_dim)
  dtype = jnp.dtype(cfg.dtype)
  return [{'k': jnp.zeros(shape, dtype), 'v': jnp.zeros(shape, dtype)} for _ in range(num_layers)]


class Attention(nnx.Module):
  """Grouped-query attention with RoPE and optional qk-norm; writes its KV cache by position."""
  MATRICES = {'wq': 1, 'wk': 1, 'wv': 1, 'wo': 2}  # matrix: its leading (input) axes (`dense`)
  out_major = False

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, g, e = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.wq = param(rngs, _dense_init, (d, h, e), ('embed', 'heads', 'head_dim'))
    self.wk = param(rngs, _dense_init, (d, g, e), ('embed', 'kv_heads', 'head_dim'))
    self.wv = param(rngs, _dense_init, (d, g, e), ('embed', 'kv_heads', 'head_dim'))
    self.wo = param(rngs, _dense_init_in_axes(0, 1), (h, e, d), ('heads', 'head_dim', 'embed'))
    if cfg.attn_bias:
      self.bq = param(rngs, nnx.initializers.zeros, (h, e), ('heads', 'head_dim'))
      self.bk = param(rngs, nnx.initializers.zeros, (g, e), ('kv_heads', 'head_dim'))
      self.bv = param(rngs, nnx.initializers.zeros, (g, e), ('kv_heads', 'head_dim'))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(e, cfg.norm_eps, rngs)
      self.k_norm = RMSNorm(e, cfg.norm_eps, rngs)

  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, cache: Cache | None = None, slots_BxT=None):
    """`slots_BxT`: the cache slots this call writes (default: the positions; a tree pass writes
    nodes that share a position into slots of their own)."""
    cfg, om = self.cfg, self.out_major
    b, t, _ = x_BxTxD.shape
    h, g, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_BxTxHxE = dense('btd,dhe->bthe', x_BxTxD, self.wq[...], om).reshape(b, t, h, e)
    k_BxTxGxE = dense('btd,dge->btge', x_BxTxD, self.wk[...], om).reshape(b, t, g, e)
    v_BxTxGxE = dense('btd,dge->btge', x_BxTxD, self.wv[...], om).reshape(b, t, g, e)
    if cfg.attn_bias:
      q_BxTxHxE, k_BxTxGxE, v_BxTxGxE = (x + bias[...].astype(x.dtype) for x, bias in
                                        ((q_BxTxHxE, self.bq), (k_BxTxGxE, self.bk), (v_BxTxGxE, self.bv)))
    if cfg.qk_norm:
      q_BxTxHxE, k_BxTxGxE = self.q_norm(q_BxTxHxE), self.k_norm(k_BxTxGxE)
    q_BxTxHxE = rope(q_BxTxHxE, positions_BxT, cfg.rope_base, cfg.rope_interleaved, cfg.rope_scaling)
    k_BxTxGxE = rope(k_BxTxGxE, positions_BxT, cfg.rope_base, cfg.rope_interleaved, cfg.rope_scaling)
    if cache is not None:  # write this call's keys at their slots, then attend over the cache
      b_Bx1 = jnp.arange(positions_BxT.shape[0])[:, None]
      slots_BxT = positions_BxT if slots_BxT is None else slots_BxT
      cache = {'k': cache['k'].at[b_Bx1, :, slots_BxT].set(k_BxTxGxE, mode='drop'),
               'v': cache['v'].at[b_Bx1, :, slots_BxT].set(v_BxTxGxE, mode='drop')}
      k_BxGxSxE, v_BxGxSxE = cache['k'], cache['v']
    else:
      k_BxGxSxE, v_BxGxSxE = k_BxTxGxE.transpose(0, 2, 1, 3), v_BxTxGxE.transpose(0, 2, 1, 3)
    q_BxTxGxQheadsxE = q_BxTxHxE.reshape(b, t, g, h // g, e)
    scores_BxGxQheadsxTxS = jnp.einsum('btgqe,bgse->bgqts', q_BxTxGxQheadsxE, k_BxGxSxE,
                                  preferred_element_type=jnp.float32) / jnp.sqrt(e).astype(jnp.float32)
    scores_BxGxQheadsxTxS = jnp.where(mask_BxTxS[:, None, None], scores_BxGxQheadsxTxS, -1e30)
    probs_BxGxQheadsxTxS = jax.nn.softmax(scores_BxGxQheadsxTxS, axis=-1).astype(x_BxTxD.dtype)  # softmax in f32
    out_BxTxGxQheadsxE = jnp.einsum('bgqts,bgse->btgqe', probs_BxGxQheadsxTxS, v_BxGxSxE)
    out_BxTxD = dense('bthe,hed->btd', out_BxTxGxQheadsxE.reshape(b, t, h, e), self.wo[...], om)
    return out_BxTxD, cache


class MLP(nnx.Module):
  """SwiGLU feed-forward of width `width` (default cfg.mlp_dim)."""
  MATRICES = {'w_gate': 1, 'w_up': 1, 'w_down': 1}
  out_major = False

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int | None = None):
    d, f = cfg.dim, width or cfg.mlp_dim
    self.w_gate = param(rngs, _dense_init, (d, f), ('embed', 'mlp'))
    self.w_up = param(rngs, _dense_init, (d, f), ('embed', 'mlp'))
    self.w_down = param(rngs, _dense_init, (f, d), ('mlp', 'embed'))

  def __call__(self, x_BxTxD):
    om = self.out_major
    gate_BxTxF = dense('btd,df->btf', x_BxTxD, self.w_gate[...], om)
    up_BxTxF = dense('btd,df->btf', x_BxTxD, self.w_up[...], om)
    return dense('btf,fd->btd', jax.nn.silu(gate_BxTxF) * up_BxTxF, self.w_down[...], om)


class Block(nnx.Module):
  """Pre-norm transformer block: x + Attn(RMSNorm(x)), then + FFN(RMSNorm(.)), FFN a SwiGLU MLP or
  routed experts (plus shared experts, one SwiGLU of width s·F)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, rngs)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, rngs)
    m = cfg.moe
    if m.num_experts:
      self.moe = MoE(cfg.dim, m, rngs)
      if m.num_shared_experts:
        self.shared_mlp = MLP(cfg, rngs, width=m.num_shared_experts * m.expert_dim)
    else:
      self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, cache: Cache | None = None, slots_BxT=None, *,
               dropless: bool = True, move_bias: bool = False):
    """(x, cache, routing stats or None); `dropless=False` applies the experts' capacity limit and
    `move_bias` moves the router's balancing bias (moe.MoE)."""
    attn_BxTxD, cache = self.attn(self.attn_norm(x_BxTxD), positions_BxT, mask_BxTxS, cache, slots_BxT)
    x_BxTxD = x_BxTxD + attn_BxTxD
    h_BxTxD = self.mlp_norm(x_BxTxD)
    if not hasattr(self, 'moe'):
      return x_BxTxD + self.mlp(h_BxTxD), cache, None
    ffn_BxTxD, stats = self.moe(h_BxTxD, dropless=dropless, move_bias=move_bias)
    if hasattr(self, 'shared_mlp'):
      ffn_BxTxD = ffn_BxTxD + self.shared_mlp(h_BxTxD)
    return x_BxTxD + ffn_BxTxD, cache, stats


def _run_block(block: Block, remat: bool, *args, **moe_flags):
  if remat:
    return nnx.remat(lambda blk, *a: blk(*a, **moe_flags))(block, *args)
  return block(*args, **moe_flags)


class MTPHead(nnx.Module):
  """DeepSeek-V3 MTP module k: h^k_i = TRM_k(M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))])."""
  MATRICES = {'proj': 1}
  out_major = False

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps, rngs)
    self.embed_norm = RMSNorm(cfg.dim, cfg.norm_eps, rngs)
    self.proj = param(rngs, _dense_init, (2 * cfg.dim, cfg.dim), ('embed_in', 'embed'))
    self.block = Block(cfg, rngs)
    self.remat = cfg.remat

  def __call__(self, h_prev_BxTxD, emb_BxTxD, positions_BxT, mask_BxTxS, cache: Cache | None = None, *,
               dropless: bool = True, move_bias: bool = False):
    """(h^k, cache, routing stats or None)."""
    x_BxTx2D = jnp.concatenate([self.hidden_norm(h_prev_BxTxD), self.embed_norm(emb_BxTxD)], axis=-1)
    x_BxTxD = dense('btc,cd->btd', x_BxTx2D, self.proj[...], self.out_major)
    return _run_block(self.block, self.remat, x_BxTxD, positions_BxT, mask_BxTxS, cache, dropless=dropless,
                      move_bias=move_bias)


class ModelOutput(NamedTuple):
  logits_BxTxV: jax.Array             # main head, f32; position i predicts token i+1
  mtp_logits_KxBxTxV: jax.Array       # head k at i predicts token i+k+1; the last k positions are padding
  hidden_K1xBxTxD: jax.Array          # h^0 (trunk, before the final norm) and h^1..h^K
  aux: dict | None = None             # MoE: moe.summarize's balancing loss and load metrics


def _positions_and_mask(tokens_BxT, segment_ids_BxT):
  b, t = tokens_BxT.shape
  positions_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
  return positions_BxT, attention_mask(positions_BxT, segment_ids_BxT)


class MTPTransformer(nnx.Module):
  """Trunk + shared output head + K MTP heads; embedding and output head are shared by all heads."""
  MATRICES = {'unembed': 1}  # untied only; the tied embedding (V x D) is out-major as it is
  out_major = False

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    keys = ParamKeys(rngs)
    self.embed = param(keys, nnx.initializers.normal(0.02), (cfg.vocab_size, cfg.dim), ('vocab', 'embed'))
    self.blocks = nnx.List([Block(cfg, keys) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.dim, cfg.norm_eps, keys)
    if not cfg.tie_embeddings:
      self.unembed = param(keys, _dense_init, (cfg.dim, cfg.vocab_size), ('embed', 'vocab'))
    self.mtp_heads = nnx.List([MTPHead(cfg, keys) for _ in range(cfg.num_mtp_heads)])
    keys.close()

  def embed_tokens(self, tokens_BxT):
    return jnp.take(self.embed[...], tokens_BxT, axis=0).astype(jnp.dtype(self.cfg.dtype))

  def trunk(self, tokens_BxT, positions_BxT, mask_BxTxS, caches: list[Cache] | None = None, slots_BxT=None):
    """Hidden states h^0 (before the final norm) and the updated per-layer caches (experts dropless);
    the caches are written at `slots_BxT` (default: at the positions)."""
    x_BxTxD, new_caches, _ = self._trunk(tokens_BxT, positions_BxT, mask_BxTxS, caches, slots_BxT, dropless=True)
    return x_BxTxD, new_caches

  def _trunk(self, tokens_BxT, positions_BxT, mask_BxTxS, caches, slots_BxT=None, *, dropless: bool,
             move_bias: bool = False):
    x_BxTxD = self.embed_tokens(tokens_BxT)
    new_caches, stats = [], []
    for layer, block in enumerate(self.blocks):
      cache = None if caches is None else caches[layer]
      x_BxTxD, cache, layer_stats = _run_block(block, self.cfg.remat, x_BxTxD, positions_BxT, mask_BxTxS, cache,
                                               slots_BxT, dropless=dropless, move_bias=move_bias)
      new_caches.append(cache)
      stats.append(layer_stats)
    return x_BxTxD, (None if caches is None else new_caches), stats

  def unembedding(self):
    """The output head's matrix D x V (the embedding's transpose when tied)."""
    return self.output_matrix().T if self.out_major else self.output_matrix()

  def output_matrix(self):
    """The output head's matrix as `logits` reads it: D x V, or V x D when out-major."""
    if self.cfg.tie_embeddings:
      return self.embed[...] if self.out_major else self.embed[...].T
    return self.unembed[...]

  def logits(self, h_BxTxD, w=None):
    """Shared output head (final RMSNorm + unembedding), returned in f32.

    `w` replaces `output_matrix()`, e.g. by some of its vocabulary entries (decoding's draft
    vocabulary), in the same layout.
    """
    x_BxTxD = self.final_norm(h_BxTxD)
    w = self.output_matrix() if w is None else w
    return dense('btd,dv->btv', x_BxTxD, w, self.out_major, preferred_element_type=jnp.float32)

  def mtp_head(self, k: int, h_prev_BxTxD, next_tokens_BxT, positions_BxT, mask_BxTxS,
               cache: Cache | None = None):
    """Head k (1-based) given h^{k-1} and the token k steps ahead of each position (experts dropless)."""
    h_BxTxD, cache, _ = self.mtp_heads[k - 1](h_prev_BxTxD, self.embed_tokens(next_tokens_BxT),
                                              positions_BxT, mask_BxTxS, cache)
    return h_BxTxD, cache

  def trunk_hidden(self, tokens_BxT, segment_ids_BxT=None):
    """h^0 of the training forward (`__call__`): what a trunk-state cache stores (trunk_cache.py)."""
    positions_BxT, mask_BxTxS = _positions_and_mask(tokens_BxT, segment_ids_BxT)
    return self._trunk(tokens_BxT, positions_BxT, mask_BxTxS, None, dropless=False)[0]

  def __call__(self, tokens_BxT, segment_ids_BxT=None, *, isolate_trunk: bool = False,
               trunk_hidden_BxTxD=None, move_router_biases: bool = False) -> ModelOutput:
    """Teacher-forced forward of the main head and all K heads over one (packed) sequence batch.

    This is the training forward: MoE layers apply their capacity limit (`moe.capacity_factor`).
    `trunk_hidden_BxTxD`: h^0 from `trunk_hidden` (a frozen trunk's cached states), skipping the
    trunk; only the heads and the output head then run (dense models: the trunk routers' terms
    would be missing from an MoE's aux loss). `move_router_biases` (the train step's forward) moves
    each MoE router's balancing bias by its step (moe.RouterBias).
    """
    b, t = tokens_BxT.shape
    positions_BxT, mask_BxTxS = _positions_and_mask(tokens_BxT, segment_ids_BxT)
    if trunk_hidden_BxTxD is None:
      h_BxTxD, _, stats = self._trunk(tokens_BxT, positions_BxT, mask_BxTxS, None, dropless=False,
                                      move_bias=move_router_biases)
    else:
      h_BxTxD, stats = trunk_hidden_BxTxD.astype(jnp.dtype(self.cfg.dtype)), []
    logits_BxTxV = self.logits(h_BxTxD)
    hiddens, mtp_logits = [h_BxTxD], []
    # isolate_trunk: the MTP losses then train the heads but never move the trunk's hidden state.
    h_prev_BxTxD = jax.lax.stop_gradient(h_BxTxD) if isolate_trunk else h_BxTxD
    for k in range(1, self.cfg.num_mtp_heads + 1):
      h_prev_BxTxD, _, head_stats = self.mtp_heads[k - 1](
          h_prev_BxTxD, self.embed_tokens(shift_left(tokens_BxT, k)), positions_BxT, mask_BxTxS, dropless=False,
          move_bias=move_router_biases)
      stats.append(head_stats)
      hiddens.append(h_prev_BxTxD)
      mtp_logits.append(self.logits(h_prev_BxTxD))
    mtp_logits_KxBxTxV = (jnp.stack(mtp_logits) if mtp_logits
                          else jnp.zeros((0, b, t, self.cfg.vocab_size), jnp.float32))
    aux = summarize(stats, self.cfg.moe) if self.cfg.moe.num_experts else None
    return ModelOutput(logits_BxTxV, mtp_logits_KxBxTxV, jnp.stack(hiddens), aux)


def param_count(cfg: ModelConfig, *, active: bool = False) -> int:
  """Closed-form parameter count, checked against the built model in the tests.

  `active`: per token, counting only the top-k routed experts of each MoE layer (the embedding,
  router and shared experts count in full); equal to the total for a dense model.
  """
  d, h, g, e, f, v = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  m = cfg.moe
  if m.num_experts:  # router + its bias, routed experts, shared experts
    routed = m.top_k if active else m.num_experts
    ffn = d * m.num_experts + m.num_experts + 3 * d * m.expert_dim * (routed + m.num_shared_experts)
  else:
    ffn = 3 * d * f
  block = (2 * d + d * h * e + 2 * d * g * e + h * e * d + ffn + (2 * e if cfg.qk_norm else 0)
           + ((h + 2 * g) * e if cfg.attn_bias else 0))
  head = 2 * d + 2 * d * d + block
  return v * d * (1 if cfg.tie_embeddings else 2) + cfg.num_layers * block + d + cfg.num_mtp_heads * head
