"""The paper's two models (Table 3) at full size, abstractly: parameter counts, and the sharded train
step lowers for 8 fake devices (traced and lowered only: never compiled or run)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import base
from configs import model as model_presets
from mtpd_jax import model, sharding
from mtpd_jax.harness import recipe, training, validation


def _config(preset: str, num_mtp_heads: int):
  c = base.get_config()
  model_presets.apply(c, preset)
  c.model.num_mtp_heads = num_mtp_heads
  c.distill.top_n = 10_000  # the paper's N
  c.data.seq_len, c.data.batch_size = 512, 8
  c.model.dtype = 'bfloat16'
  return c


def _abstract_params(config):
  mesh = sharding.make_mesh((1, 1, 1), ('data', 'fsdp', 'model'), devices=jax.devices()[:1])
  abstract, _ = training.abstract_state(config, mesh)  # nnx.eval_shape: no parameter is allocated
  return abstract.params


@pytest.mark.parametrize('preset,total,active', [
    ('dense_2b', (1.95e9, 2.15e9), (1.95e9, 2.15e9)),
    ('moe_10b_a1b', (9.5e9, 10.5e9), (0.95e9, 1.1e9)),
])
def test_paper_scale_parameter_counts(preset, total, active):
  config = _config(preset, num_mtp_heads=0)  # the backbone alone (MTP heads are extra, as in DeepSeek-V3)
  validation.validate_config(config)
  cfg = recipe.model_config(config)
  params = _abstract_params(config)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  n_total = sum(x.size for _, x in leaves)
  routed = sum(x.size for p, x in leaves if re.search(r"\['moe'\]\['w_(gate|up|down)'\]", jax.tree_util.keystr(p)))
  n_active = n_total - (routed * (cfg.moe.num_experts - cfg.moe.top_k) // cfg.moe.num_experts if routed else 0)
  assert n_total == model.param_count(cfg) and n_active == model.param_count(cfg, active=True)
  assert total[0] < n_total < total[1], f'{preset}: {n_total / 1e9:.3f}B parameters'
  assert active[0] < n_active < active[1], f'{preset}: {n_active / 1e9:.3f}B active'
  # Table 3 itself.
  assert (cfg.head_dim, cfg.num_kv_heads, cfg.tie_embeddings, cfg.qk_norm) == (128, 4, False, True)
  assert (cfg.dim, cfg.num_heads) == {'dense_2b': (2048, 16), 'moe_10b_a1b': (1536, 32)}[preset]


@pytest.mark.parametrize('preset,mesh_shape,mesh_axes', [
    ('dense_2b', (4, 2), ('fsdp', 'model')),
    ('moe_10b_a1b', (2, 4), ('fsdp', 'expert')),
])
def test_paper_scale_train_step_lowers_on_8_fake_devices(preset, mesh_shape, mesh_axes):
  config = _config(preset, num_mtp_heads=1)
  config.mesh.shape, config.mesh.axes = mesh_shape, mesh_axes
  validation.validate_config(config)
  mesh = sharding.make_mesh(mesh_shape, mesh_axes)
  assert mesh.size == 8
  with jax.set_mesh(mesh):
    abstract, shardings = training.abstract_state(config, mesh)
    step_fn, _ = training.make_steps(config, mesh, shardings)
    batch_sh = NamedSharding(mesh, sharding.batch_spec(mesh))
    shape = (config.data.batch_size, config.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sh)
             for k in ('inputs', 'targets', 'segment_ids', 'target_segment_ids')}
    lowered = step_fn.lower(abstract, batch)
  text = lowered.as_text()
  assert 'sharding' in text and 'func.func public @main' in text
  block = shardings.params['blocks'][0]
  if preset == 'moe_10b_a1b':  # 128 experts over 4 devices, their input width over the 2 fsdp ones
    assert block['moe']['w_gate'].value.spec == P('expert', 'fsdp', None)
    assert block['shared_mlp']['w_gate'].value.spec == P('fsdp', None)
  else:
    assert block['mlp']['w_gate'].value.spec == P('fsdp', 'model')
  want_embed = P('model', 'fsdp') if 'model' in mesh_axes else P(None, 'fsdp')  # vocab 122,880 over 'model'
  assert shardings.params['embed'].value.spec == want_embed
