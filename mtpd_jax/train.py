"""TrainState, the jitted train and eval steps, and the training loop.

The loop dispatches step t, then pulls step t-1's metrics to the host, so the host never waits on
the device except at logging, checkpointing and evaluation points.
"""

import functools
import json
import os
import time

import flax
import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpd_jax import (checkpoint, fused_loss, gguf_llama, losses, moe, recipe, runtime, sharding,
                      trunk_cache, workdir_lock)
from mtpd_jax.model import MTPTransformer


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState
  graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)


# State creation (abstract first, then a sharded jit init)


def init_train_state(config: ml_collections.ConfigDict, abstract: TrainState,
                     shardings: TrainState) -> TrainState:
  """A freshly initialised TrainState, each array created directly in its sharding."""
  mcfg = recipe.model_config(config)

  def init():
    _, params = nnx.split(MTPTransformer(mcfg, rngs=nnx.Rngs(config.seed)), nnx.Param)
    return params, abstract.tx.init(params)
  params, opt_state = jax.jit(init, out_shardings=(shardings.params, shardings.opt_state))()
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
  return abstract.replace(step=step, params=params, opt_state=opt_state)


def transplant(params: nnx.State, source: nnx.State, *, loop_heads: bool) -> nnx.State:
  """`params` with every parameter that `source` has at the same path taken from it.

  MTP heads that `source` lacks keep their fresh initialisation, or with `loop_heads` become
  copies of source head ((j-1) mod m)+1: the looped extension's block copy (Fig. 2).
  """
  src = dict(jax.tree_util.tree_leaves_with_path(source))
  num_src_heads = len(source['mtp_heads']) if 'mtp_heads' in source else 0

  def one(path, leaf):
    keys = [getattr(p, 'key', None) for p in path]
    if path not in src and keys[0] == 'mtp_heads' and loop_heads and num_src_heads:
      path = (path[0], jax.tree_util.DictKey(keys[1] % num_src_heads)) + path[2:]
    if path not in src:
      if keys[0] != 'mtp_heads':
        raise ValueError(f'init_from lacks parameter {jax.tree_util.keystr(path)}')
      return leaf
    if src[path].shape != leaf.shape:
      raise ValueError(f'init_from parameter {jax.tree_util.keystr(path)} has shape {src[path].shape}, '
                       f'this model {leaf.shape}')
    return src[path]
  return jax.tree_util.tree_map_with_path(one, params)


def warm_start(config: ml_collections.ConfigDict, abstract: TrainState, shardings: TrainState,
               mesh) -> TrainState:
  """A fresh state whose parameters come from `train.init_from`, with fresh optimizer moments.

  `init_from` is a training workdir or a llama GGUF checkpoint (a .gguf path or 'smollm2').
  Parameters it lacks (new MTP heads) get the fresh initialisation, which is not even built when
  it has them all (a looped stage copies every new head).
  """
  if gguf_llama.is_gguf(config.train.init_from):
    params = gguf_llama.init_params(abstract.graphdef, init_train_state(config, abstract, shardings).params,
                                    config.train.init_from, trunk_heads=config.train.init_heads == 'trunk')
  else:
    source, _ = restore_model(config.train.init_from, mesh)
    params = transplant(abstract.params, nnx.state(source, nnx.Param),
                        loop_heads=config.train.init_heads == 'loop')
    missing = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    if any(missing(x) for x in jax.tree.leaves(params)):
      fresh = init_train_state(config, abstract, shardings).params
      params = jax.tree.map(lambda p, f: f if missing(p) else p, params, fresh)
  # A fresh buffer per parameter, in its sharding: looped heads must not alias one donated buffer.
  params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params)(params)
  return abstract.replace(step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step), params=params,
                          opt_state=jax.jit(abstract.tx.init, out_shardings=shardings.opt_state)(params))


def abstract_train_state(config: ml_collections.ConfigDict, mesh) -> tuple[TrainState, TrainState]:
  """TrainState of ShapeDtypeStructs (carrying shardings) and the tree of NamedShardings."""
  model = nnx.eval_shape(lambda: MTPTransformer(recipe.model_config(config), rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(model, nnx.Param)
  tx = recipe.make_optimizer(config, recipe.trainable_labels(abstract_params, config.train.trainable))
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  replicated = NamedSharding(mesh, P())
  param_sh = sharding.param_shardings(abstract_params, mesh)
  opt_sh = sharding.like_params_shardings(abstract_opt, abstract_params, param_sh, mesh)
  shardings = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, graphdef=graphdef, tx=tx)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                                     opt_state=abstract_opt, graphdef=graphdef, tx=tx), shardings)
  return abstract, shardings


# ---------------------------------------------------------------------------------------------
# Steps


def fused_grad_flags(labels) -> dict[str, bool]:
  """Which gradients the fused loss must form, from the 'train'/'frozen' labels of the parameters:
  the unembedding's only if it trains, the main head's row only if something below it trains."""
  top = {}
  for path, label in jax.tree_util.tree_leaves_with_path(labels):
    name = getattr(path[0], 'key', None)
    top[name] = top.get(name, False) or label == 'train'
  below_main = [trains for name, trains in top.items() if name not in ('mtp_heads', 'unembed')]
  return dict(w_grad=top.get('unembed', top.get('embed', True)), main_grad=any(below_main))


def _forward_loss(params, graphdef, batch, *, loss_kw, isolate_trunk, beta_scale, loss_chunk_rows=0,
                  router_bias_delta=False, grad_flags=None):
  model = nnx.merge(graphdef, params)
  out = model(batch['inputs'], batch['segment_ids'], isolate_trunk=isolate_trunk,
              trunk_hidden_BxTxD=batch.get('trunk_hidden'))  # a frozen trunk's cached states
  labels = (batch['targets'], batch['segment_ids'], batch['target_segment_ids'])
  if loss_chunk_rows and fused_loss.supported(**loss_kw):
    # The loss reads the final-normed hidden states and the unembedding in row chunks; the model's
    # logits go unused and XLA drops them, so no [K+1, B, T, V] array is materialised.
    w_DxV = model.embed[...].T if model.cfg.tie_embeddings else model.unembed[...]
    loss, metrics = fused_loss.mtp_d_loss_fused(model.final_norm(out.hidden_K1xBxTxD), w_DxV, *labels,
                                                beta_scale=beta_scale, chunk_rows=loss_chunk_rows, **loss_kw,
                                                **(grad_flags or {}))
  else:
    loss, metrics = losses.mtp_d_loss(out.logits_BxTxV, out.mtp_logits_KxBxTxV, *labels,
                                      beta_scale=beta_scale, **loss_kw)
  # MoE: + the router's balancing loss; moe/* load metrics (and, for train_step, the bias steps).
  return moe.add_router_terms(loss, metrics, out.aux, with_bias_delta=router_bias_delta)


def train_step(state: TrainState, batch, *, loss_kw, isolate_trunk, kl_warmup_steps, labels,
               schedule, skip_nonfinite, loss_chunk_rows=0):
  """One optimizer step; metrics come back unprefixed (`loss`, `mtp/k1/xent`, ...)."""
  beta_scale = (jnp.minimum(1.0, state.step / kl_warmup_steps) if kl_warmup_steps else 1.0)

  def loss_fn(params):
    # Frozen parameters get no gradient at all, so XLA drops their backward pass.
    params = jax.tree.map(lambda p, l: p if l == 'train' else jax.lax.stop_gradient(p), params, labels)
    return _forward_loss(params, state.graphdef, batch, loss_kw=loss_kw, isolate_trunk=isolate_trunk,
                         beta_scale=beta_scale, loss_chunk_rows=loss_chunk_rows, router_bias_delta=True,
                         grad_flags=fused_grad_flags(labels))
  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  bias_delta = metrics.pop('moe/router_bias_delta', None)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  if bias_delta:  # MoE with bias balancing: each router bias steps toward even load (zero gradient)
    params = moe.apply_router_bias_delta(params, bias_delta, labels)
  metrics['grad_norm'] = optax.global_norm(grads)
  metrics['lr'] = schedule(state.step)
  finite = jnp.isfinite(metrics['loss']) & jnp.isfinite(metrics['grad_norm'])
  metrics['finite'] = finite
  if skip_nonfinite:  # keep the old params and moments; the step counter still advances
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                     (params, opt_state), (state.params, state.opt_state))
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(state: TrainState, batch, *, loss_kw, isolate_trunk):
  _, metrics = _forward_loss(state.params, state.graphdef, batch, loss_kw=loss_kw,
                             isolate_trunk=isolate_trunk, beta_scale=1.0)
  return metrics


def make_steps(config: ml_collections.ConfigDict, mesh, shardings: TrainState):
  """The one jitted train step (sharded, donating the state) and the jitted eval step."""
  labels = recipe.trainable_labels(shardings.params, config.train.trainable)
  kw = dict(loss_kw=recipe.loss_kwargs(config), isolate_trunk=config.mtp.isolate_trunk)
  batch_sh = NamedSharding(mesh, sharding.batch_spec(mesh))
  step_fn = jax.jit(functools.partial(train_step, **kw, labels=labels, schedule=recipe.learning_rate(config),
                                      kl_warmup_steps=config.distill.warmup_steps,
                                      skip_nonfinite=config.train.on_nan == 'skip',
                                      loss_chunk_rows=config.train.loss_chunk_rows),
                    in_shardings=(shardings, batch_sh), out_shardings=(shardings, None),
                    donate_argnums=0)
  eval_fn = jax.jit(functools.partial(eval_step, **kw), in_shardings=(shardings, batch_sh))
  return step_fn, eval_fn


# ---------------------------------------------------------------------------------------------
# The loop


def _to_host(metrics) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def evaluate_loss(config, state, eval_fn, mesh, cache=None) -> dict[str, float]:
  """Mean metrics over `train.eval_batches` held-out batches (the same batches every time)."""
  it = recipe.make_data_iterator(config, 'eval', cache)
  sums: dict[str, float] = {}
  for _ in range(config.train.eval_batches):
    m = _to_host(eval_fn(state, sharding.put_batch(next(it), mesh)))
    sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
  return {f'eval/{k}': v / config.train.eval_batches for k, v in sums.items()}


def check_workdir(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuse a workdir whose checkpoints this config must not touch: another model, a resume that
  would change the loss or the data order (runtime.MAY_CHANGE_ON_RESUME lists what may change),
  checkpoints without the config.json that says what they are, or any reuse under resume=never."""
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  if not (os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))):
    return
  if config.train.resume == 'never':
    raise ValueError(f'train.resume=never, but {workdir} already holds checkpoints; choose a fresh --workdir')
  if not os.path.exists(os.path.join(workdir, 'config.json')):
    raise ValueError(f'{workdir} holds checkpoints but no config.json, so nothing says which model they '
                     'belong to; put its config.json back or use another --workdir')
  saved, current = saved_config(workdir).to_dict(), json.loads(config.to_json())
  diffs = runtime.state_mismatch(saved, current)
  if diffs:
    raise ValueError(f'{workdir} holds checkpoints of another model ({"; ".join(diffs)}); use another --workdir')
  diffs = runtime.resume_mismatch(saved, current)
  if diffs:
    raise ValueError(f'{workdir} holds a run with other settings ({"; ".join(diffs)}); resume it with its own '
                     'settings (only logging, evaluation, checkpoint, mesh and train.steps may change) '
                     'or use another --workdir')


def _resume_or_init(config, workdir, ckpt, abstract, shardings, mesh, train_it):
  """(state, step): the newest readable checkpoint of `workdir`, else a fresh (or warm) start."""
  check_workdir(config, workdir)
  if ckpt.all_steps():
    step, state = ckpt.restore_latest_good(abstract, train_it)
    if step is not None:
      return state, step
  if config.train.init_from:
    return warm_start(config, abstract, shardings, mesh), 0
  return init_train_state(config, abstract, shardings), 0


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True):
  """Train (resuming from the newest checkpoint in `workdir`), checkpoint, evaluate.

  Returns (state, held-out metrics). SIGTERM/SIGINT checkpoint after the current step and raise
  runtime.Preempted; a non-finite step raises FloatingPointError (or is skipped: train.on_nan).
  """
  recipe.validate_config(config)
  checkpoint.check_options(config.ckpt.every_steps, config.ckpt.max_to_keep)
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  if config.data.batch_size % sharding.data_parallel_size(mesh):
    raise ValueError(f'data.batch_size={config.data.batch_size} is not divisible by the '
                     f'{sharding.data_parallel_size(mesh)}-way data-parallel mesh axes')
  with workdir_lock.hold(workdir), jax.set_mesh(mesh), runtime.PreemptionGuard() as guard:
    abstract, shardings = abstract_train_state(config, mesh)
    step_fn, eval_fn = make_steps(config, mesh, shardings)
    cache = recipe.make_trunk_cache(config)
    train_it = recipe.make_data_iterator(config, 'train', cache)
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                   every_steps=config.ckpt.every_steps, max_to_keep=config.ckpt.max_to_keep)
    ckpt.check_free_space(abstract)
    state, start = _resume_or_init(config, workdir, ckpt, abstract, shardings, mesh, train_it)
    if cache:  # the frozen trunk's states, built once for every run on this trunk and data
      cache.build(state.graphdef, state.params, {s: recipe.make_source(config, s) for s in trunk_cache.SPLITS},
                  progress=progress)
    log = runtime.MetricsLog(os.path.join(workdir, 'metrics.jsonl'), start)  # may refuse: before config.json
    if jax.process_index() == 0:
      runtime.write_atomically(os.path.join(workdir, 'config.json'), config.to_json(indent=2))
    tokens_per_step = config.data.batch_size * config.data.seq_len
    bar = runtime.progress_bar(progress, start, config.train.steps)
    pending, last_log = None, (start, time.perf_counter())

    def flush(step, metrics):  # host side of step `step` (1-based count of completed steps)
      nonlocal last_log
      m = _to_host(metrics)
      if not m.pop('finite'):
        if config.train.on_nan != 'skip':
          good = [s for s in ckpt.all_steps() if s < step]
          raise FloatingPointError(f'non-finite loss or gradient at step {step}; last good checkpoint: '
                                   f'{good[-1] if good else None} (train.on_nan=skip drops such steps)')
        log.write({'step': step, 'train/skipped_nonfinite': 1})
      if step % config.train.log_every == 0 or step == config.train.steps:
        now = time.perf_counter()
        m['tokens_per_s'] = tokens_per_step * (step - last_log[0]) / max(now - last_log[1], 1e-9)
        last_log = (step, now)
        log.write({'step': step, **{f'train/{k}': v for k, v in m.items()}})
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
      bar.update(1)

    batch = sharding.put_batch(next(train_it), mesh) if start < config.train.steps else None
    if batch is not None and jax.process_count() > 1:
      # Each process restores and compiles on its own; under load one can lag the other by more
      # than the 30 s within which gloo must set up a device group at a program's first run.
      # Compile first, then meet at a coordination-service barrier, which has no such deadline.
      step_fn = step_fn.lower(state, batch).compile()
      runtime.sync_processes('compiled')
    for step in range(start + 1, config.train.steps + 1):
      batch = batch if batch is not None else sharding.put_batch(next(train_it), mesh)
      state, metrics = step_fn(state, batch)
      batch = None
      if pending is not None:
        flush(*pending)
      pending = (step, metrics)
      guard.step = step  # the multi-process sync point compares step numbers
      stop = guard.requested()
      if (ckpt.should_save(step) or stop) and step != config.train.steps:
        flush(*pending)  # never checkpoint a state that a non-finite step produced
        pending = None
        ckpt.save(step, state, train_it)
        if stop:
          bar.close()
          ckpt.close()
          runtime.leave_together()
          raise runtime.Preempted(step, guard.signum)
      if config.train.eval_every and step % config.train.eval_every == 0:
        log.write({'step': step, **evaluate_loss(config, state, eval_fn, mesh, cache)})
    if pending is not None:
      flush(*pending)
    bar.close()
    if ckpt.latest_step() != config.train.steps:
      ckpt.save(config.train.steps, state, train_it)
    ckpt.close()
    final = evaluate_loss(config, state, eval_fn, mesh, cache)
    log.write({'step': config.train.steps, **final})
    return state, final


def saved_config(workdir: str) -> ml_collections.ConfigDict:
  """The config.json of a workdir; fields newer than it get their configs/base.py defaults."""
  from configs import base  # pylint: disable=import-outside-toplevel
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{workdir} holds no config.json: not a training workdir')
  with open(path) as f:
    try:
      saved = json.load(f)
    except ValueError as e:
      raise ValueError(f'{path} is not valid JSON ({e}); restore it from a copy or use another --workdir') from None
  if not isinstance(saved, dict):
    raise ValueError(f'{path} holds {type(saved).__name__}, not a config')
  return ml_collections.ConfigDict(runtime.with_defaults(saved, json.loads(base.get_config().to_json())))


def restore_model(workdir: str, mesh=None) -> tuple[MTPTransformer, ml_collections.ConfigDict]:
  """The trained model of a workdir (latest checkpoint) and its config.

  Parameters are placed on `mesh` by the logical axis rules (default: replicated on all devices).
  """
  config = saved_config(workdir)
  mesh = mesh or sharding.make_mesh((-1,), ('data',))
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), every_steps=0, max_to_keep=1)
  step = ckpt.latest_step()
  if step is None:
    raise FileNotFoundError(f'{workdir} holds no checkpoint')
  abstract, _ = abstract_train_state(config, mesh)
  try:
    state = ckpt.restore_named(step, abstract)
  finally:
    ckpt.close()
  return nnx.merge(state.graphdef, state.params), config
