"""Model: shapes, parameter count, causality of trunk and every MTP head, RoPE layouts, documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtpd_jax import model as M, out_major, rope

CFG = M.ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    mlp_dim=48, num_mtp_heads=3)


def _model(cfg=CFG, seed=0):
  return M.MTPTransformer(cfg, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize('tie,qk_norm,k', [(False, True, 3), (True, False, 0), (False, False, 1)])
def test_shapes_and_param_count(tie, qk_norm, k):
  cfg = M.ModelConfig(**{**CFG.__dict__, 'tie_embeddings': tie, 'qk_norm': qk_norm, 'num_mtp_heads': k})
  model = _model(cfg)
  _, params = nnx.split(model, nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(params)) == M.param_count(cfg)
  out = model(jnp.zeros((2, 10), jnp.int32))
  assert out.logits_BxTxV.shape == (2, 10, 64) and out.logits_BxTxV.dtype == jnp.float32
  assert out.mtp_logits_KxBxTxV.shape == (k, 2, 10, 64)
  assert out.hidden_K1xBxTxD.shape == (k + 1, 2, 10, 32)


def test_causality_of_trunk_and_every_head():
  """Changing token j moves the main output only at positions >= j and head k's only at >= j-k."""
  model = _model()
  tokens = jax.random.randint(jax.random.key(0), (1, 12), 0, 64)
  base = model(tokens)
  for j in (3, 7, 11):
    out = model(tokens.at[0, j].set((tokens[0, j] + 1) % 64))
    main_diff = np.abs(np.asarray(out.logits_BxTxV - base.logits_BxTxV)).max(-1)[0]
    assert np.all(main_diff[:j] == 0) and main_diff[j] > 0
    for k in range(1, CFG.num_mtp_heads + 1):
      head_diff = np.abs(np.asarray(out.mtp_logits_KxBxTxV[k - 1] - base.mtp_logits_KxBxTxV[k - 1])).max(-1)[0]
      # head k at position i reads token i+k, so token j first reaches it at i = j-k.
      assert np.all(head_diff[:max(j - k, 0)] == 0), (j, k)
      assert head_diff[j - k] > 0, (j, k)


def test_documents_do_not_attend_across_boundaries():
  model = _model()
  tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, 64)
  seg = jnp.array([[1] * 6 + [2] * 6])
  base = model(tokens, seg)
  out = model(tokens.at[0, 2].set((tokens[0, 2] + 5) % 64), seg)  # a token of document 1
  diff = np.abs(np.asarray(out.hidden_K1xBxTxD[0] - base.hidden_K1xBxTxD[0])).max(-1)[0]
  assert diff[2] > 0 and np.all(diff[6:] == 0)
  # Document 2 alone gives the same trunk states as inside the packed row (positions differ, RoPE is relative).
  alone = model(tokens[:, 6:])
  np.testing.assert_allclose(alone.hidden_K1xBxTxD[0], base.hidden_K1xBxTxD[0][:, 6:], atol=2e-5)


@pytest.mark.slow
def test_isolate_trunk_stops_mtp_gradient_into_the_trunk():
  model = _model()
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 64)

  def head_loss(p, isolate):
    return nnx.merge(graphdef, p)(tokens, isolate_trunk=isolate).mtp_logits_KxBxTxV.sum()
  for isolate, zero in ((True, True), (False, False)):
    g = jax.grad(head_loss)(params, isolate)
    trunk_norm = sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(g['blocks']))
    assert (trunk_norm == 0) == zero
    assert sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(g['mtp_heads'])) > 0


def test_rope_layouts_are_a_permutation_of_each_other():
  """Interleaved pairs (2j, 2j+1) equal rotate_half pairs (j, j+E/2) after permuting the features."""
  x = jax.random.normal(jax.random.key(3), (2, 5, 3, 8))
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])  # interleaved -> halves
  inter = rope.rope(x, pos, 10_000.0, interleaved=True)
  half = rope.rope(x[..., perm], pos, 10_000.0, interleaved=False)
  np.testing.assert_allclose(inter[..., perm], half, atol=1e-5)
  # Position 0 is the identity; norms are preserved.
  np.testing.assert_allclose(inter[:, 0], x[:, 0], atol=1e-6)
  np.testing.assert_allclose(jnp.linalg.norm(inter, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)


def test_bf16_compute_keeps_f32_params_and_close_logits():
  cfg16 = M.ModelConfig(**{**CFG.__dict__, 'dtype': 'bfloat16'})
  tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, 64)
  m32, m16 = _model(), _model(cfg16)
  _, p16 = nnx.split(m16, nnx.Param)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p16))
  out32, out16 = m32(tokens), m16(tokens)
  assert out16.logits_BxTxV.dtype == jnp.float32
  np.testing.assert_allclose(out16.logits_BxTxV, out32.logits_BxTxV, atol=0.1)


def test_kv_cache_trunk_matches_full_forward():
  model = _model()
  tokens = jax.random.randint(jax.random.key(5), (2, 10), 0, 64)
  pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
  caches = M.init_cache(CFG, 2, 16, CFG.num_layers)
  h1, caches = model.trunk(tokens[:, :6], pos[:, :6], M.cache_mask(pos[:, :6], 16), caches)
  h2, _ = model.trunk(tokens[:, 6:], pos[:, 6:], M.cache_mask(pos[:, 6:], 16), caches)
  np.testing.assert_allclose(jnp.concatenate([h1, h2], 1), model(tokens).hidden_K1xBxTxD[0], atol=1e-5)


@pytest.mark.parametrize('tie,experts', [(False, 0), (True, 4)])
def test_out_major_matrices_give_the_same_model(tie, experts):
  """Decoding's CPU layout: each dense matrix stored as one O x I matrix and read as W @ x^T. Only
  the float order changes; the tied embedding and the experts' matrices are left as they are."""
  moe = M.MoEConfig(num_experts=experts, num_shared_experts=1 if experts else 0, expert_dim=16)
  cfg = M.ModelConfig(**{**CFG.__dict__, 'tie_embeddings': tie, 'moe': moe})
  model = _model(cfg)
  graphdef, params = nnx.split(model, nnx.Param)
  om = out_major.set_out_major(nnx.merge(graphdef, out_major.out_major_params(model, params)))
  d, he = cfg.dim, cfg.num_heads * cfg.head_dim
  attn, head = om.blocks[0].attn, om.mtp_heads[0]
  np.testing.assert_array_equal(attn.wq[...], model.blocks[0].attn.wq[...].reshape(d, he).T)
  np.testing.assert_array_equal(attn.wo[...], model.blocks[0].attn.wo[...].reshape(he, d).T)
  assert head.proj[...].shape == (d, 2 * d) and om.embed[...].shape == (cfg.vocab_size, d)
  ffn = om.blocks[1].shared_mlp if experts else om.blocks[1].mlp
  assert ffn.w_down[...].shape == (d, ffn.w_down[...].size // d) and ffn.out_major
  if experts:
    np.testing.assert_array_equal(om.blocks[0].moe.w_gate[...], model.blocks[0].moe.w_gate[...])
  else:
    assert om.unembed[...].shape == (cfg.vocab_size, d)
  np.testing.assert_array_equal(om.unembedding(), model.unembedding())
  tokens = jax.random.randint(jax.random.key(8), (2, 10), 0, 64)
  want, got = model(tokens), jax.jit(lambda t: om(t))(tokens)
  np.testing.assert_allclose(got.logits_BxTxV, want.logits_BxTxV, atol=1e-5)
  np.testing.assert_allclose(got.mtp_logits_KxBxTxV, want.mtp_logits_KxBxTxV, atol=1e-5)


@pytest.mark.parametrize('rows', [1, 4, 5, 7, 8, 9, 15, 16, 17])
def test_out_major_dense_equals_einsum_at_every_row_count(rows):
  """W @ x^T pads 5-15 rows to the next multiple of 8 (out_major.dense); the padding never shows."""
  x = jax.random.normal(jax.random.key(1), (1, rows, 12))
  w_DxHxE = jax.random.normal(jax.random.key(2), (12, 2, 5))
  got = out_major.dense('btd,dhe->bthe', x, w_DxHxE.reshape(12, 10).T, out_major=True)
  assert got.shape == (1, rows, 10)
  np.testing.assert_allclose(got.reshape(1, rows, 2, 5), out_major.dense('btd,dhe->bthe', x, w_DxHxE), atol=1e-5)


def test_remat_gives_identical_outputs():
  tokens = jax.random.randint(jax.random.key(6), (2, 8), 0, 64)
  cfg_r = M.ModelConfig(**{**CFG.__dict__, 'remat': True})
  np.testing.assert_array_equal(_model(cfg_r)(tokens).mtp_logits_KxBxTxV, _model()(tokens).mtp_logits_KxBxTxV)


def test_invalid_config_raises():
  with pytest.raises(ValueError, match='multiple of num_kv_heads'):
    M.ModelConfig(num_heads=4, num_kv_heads=3)


def test_init_keys_are_the_streams_keys_and_jit_builds_the_same_model():
  """ParamKeys hands out nnx's own stream keys (fold_in(key, count + i)) and leaves the stream's
  count where per-parameter rngs.params() calls would; a jitted build draws the same values (to
  float rounding: XLA fuses the truncated normal differently under jit)."""
  rngs = nnx.Rngs(7)
  model = M.MTPTransformer(CFG, rngs=rngs)
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert int(rngs.params.count[...]) == len(params)  # one key per parameter
  first = nnx.initializers.normal(0.02)(jax.random.fold_in(jax.random.key(7), 0), (CFG.vocab_size, CFG.dim))
  np.testing.assert_array_equal(model.embed[...], first)  # the embedding is drawn first
  jitted = nnx.jit(lambda: M.MTPTransformer(CFG, rngs=nnx.Rngs(7)))()
  for a, b in zip(params, jax.tree.leaves(nnx.state(jitted, nnx.Param))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
