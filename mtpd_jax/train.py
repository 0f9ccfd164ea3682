"""TrainState, the jitted train and eval steps, and the training loop (the only ConfigDict reader).

The loop dispatches step t, then pulls step t-1's metrics to the host, so the host never waits on
the device except at logging, checkpointing and evaluation points.
"""

import functools
import json
import math
import os
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpd_jax import checkpoint, data, losses, sharding
from mtpd_jax.model import ModelConfig, MTPTransformer

BETA_SCHEDULES = ('constant', 'exp_decay', 'linear_decay', 'linear_increase')


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState
  graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)


# ---------------------------------------------------------------------------------------------
# Config -> library arguments


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raise ValueError naming the first bad field, before any work starts."""
  m, d, k = config.model, config.distill, config.mtp.num_heads
  choices = {'distill.kl': (d.kl, losses.KL_DIRECTIONS), 'distill.teacher': (d.teacher, losses.TEACHERS),
             'distill.top_n_mode': (d.top_n_mode, losses.TOP_N_MODES),
             'distill.beta_schedule': (d.beta_schedule, BETA_SCHEDULES),
             'train.on_nan': (config.train.on_nan, ('stop', 'skip')),
             'model.dtype': (m.dtype, ('float32', 'bfloat16'))}
  for name, (value, allowed) in choices.items():
    if value not in allowed:
      raise ValueError(f'{name}={value!r} is not one of {allowed}')
  if k < 0:
    raise ValueError(f'mtp.num_heads={k} must be >= 0')
  if d.top_n is not None and not (isinstance(d.top_n, int) and 1 <= d.top_n <= m.vocab_size):
    raise ValueError(f'distill.top_n={d.top_n!r} must be None or an int in [1, vocab_size={m.vocab_size}]')
  if d.tau <= 0:
    raise ValueError(f'distill.tau={d.tau} must be > 0')
  if any(b < 0 for b in resolve_beta(config)):
    raise ValueError(f'distill.beta={d.beta!r} must be non-negative')
  if config.data.seq_len > m.max_seq_len:
    raise ValueError(f'data.seq_len={config.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}')
  if config.train.steps < 1:
    raise ValueError(f'train.steps={config.train.steps} must be >= 1')
  trainable_labels({}, config.train.trainable)  # raises on a bad value
  if isinstance(config.train.trainable, (list, tuple)) and not all(1 <= h <= k for h in config.train.trainable):
    raise ValueError(f'train.trainable={config.train.trainable!r}: head indices must lie in 1..{k}')
  model_config(config)  # ModelConfig checks its own shape constraints


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig(**config.model.to_dict(), num_mtp_heads=config.mtp.num_heads)


def resolve_beta(config: ml_collections.ConfigDict) -> tuple[float, ...]:
  """β_k per head: explicit per-head values, or a base β shaped by `beta_schedule` over depth k."""
  d, num_heads = config.distill, config.mtp.num_heads
  if isinstance(d.beta, (list, tuple)):
    if len(d.beta) != num_heads:
      raise ValueError(f'distill.beta has {len(d.beta)} values for mtp.num_heads={num_heads}')
    return tuple(float(b) for b in d.beta)
  base = (1.0 if num_heads == 1 else 0.5) if d.beta is None else float(d.beta)  # SPEC §2.5
  weights = {'constant': lambda k: 1.0,
             'exp_decay': lambda k: d.step_gamma ** (k - 1),
             'linear_decay': lambda k: (num_heads - k + 1) / num_heads,
             'linear_increase': lambda k: k / num_heads}
  if d.beta_schedule not in weights:
    raise ValueError(f'unknown distill.beta_schedule {d.beta_schedule!r}; expected one of {BETA_SCHEDULES}')
  return tuple(base * weights[d.beta_schedule](k) for k in range(1, num_heads + 1))


def loss_kwargs(config: ml_collections.ConfigDict) -> dict[str, Any]:
  d = config.distill
  return dict(ce_weight=config.mtp.ce_weight, beta=resolve_beta(config), distill=d.enabled,
              top_n=d.top_n, top_n_mode=d.top_n_mode, renormalize=d.renormalize, kl=d.kl,
              tau=d.tau, detach=d.detach, teacher=d.teacher)


def trainable_labels(params: nnx.State, trainable) -> Any:
  """'train' or 'frozen' for every parameter; `trainable` is 'all', 'mtp_heads' or 1-based head ids."""
  if trainable == 'all':
    return jax.tree.map(lambda _: 'train', params)
  if trainable == 'mtp_heads':
    heads = None
  elif isinstance(trainable, (list, tuple)) and all(isinstance(k, int) for k in trainable):
    heads = {k - 1 for k in trainable}
  else:
    raise ValueError(f"train.trainable={trainable!r}: expected 'all', 'mtp_heads' or a list of head indices")

  def label(path, _):
    keys = [getattr(p, 'key', None) for p in path]
    is_head = keys[0] == 'mtp_heads' and (heads is None or keys[1] in heads)
    return 'train' if is_head else 'frozen'
  return jax.tree_util.tree_map_with_path(label, params)


def learning_rate(config: ml_collections.ConfigDict) -> optax.Schedule:
  t = config.train
  warmup = max(1, int(t.warmup_frac * t.steps))
  return optax.warmup_cosine_decay_schedule(0.0, t.lr, warmup, max(t.steps, warmup + 1),
                                            end_value=t.lr * t.min_lr_frac)


def make_optimizer(config: ml_collections.ConfigDict, labels) -> optax.GradientTransformation:
  """AdamW per Table 4 with clipping; frozen parameters get no update and no optimizer moments."""
  t = config.train
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norm scales
  adamw = optax.chain(optax.clip_by_global_norm(t.clip_norm),
                      optax.adamw(learning_rate(config), t.b1, t.b2, t.eps,
                                  weight_decay=t.weight_decay, mask=decay_mask))
  if all(label == 'train' for label in jax.tree.leaves(labels)):
    return adamw
  return optax.multi_transform({'train': adamw, 'frozen': optax.set_to_zero()}, labels)


# ---------------------------------------------------------------------------------------------
# State creation (abstract first, then a sharded jit init)


def init_train_state(config: ml_collections.ConfigDict, abstract: TrainState,
                     shardings: TrainState) -> TrainState:
  """A freshly initialised TrainState, each array created directly in its sharding."""
  mcfg = model_config(config)

  def init():
    _, params = nnx.split(MTPTransformer(mcfg, rngs=nnx.Rngs(config.seed)), nnx.Param)
    return params, abstract.tx.init(params)
  params, opt_state = jax.jit(init, out_shardings=(shardings.params, shardings.opt_state))()
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
  return abstract.replace(step=step, params=params, opt_state=opt_state)


def abstract_train_state(config: ml_collections.ConfigDict, mesh) -> tuple[TrainState, TrainState]:
  """TrainState of ShapeDtypeStructs (carrying shardings) and the tree of NamedShardings."""
  model = nnx.eval_shape(lambda: MTPTransformer(model_config(config), rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(model, nnx.Param)
  tx = make_optimizer(config, trainable_labels(abstract_params, config.train.trainable))
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


def _forward_loss(params, graphdef, batch, *, loss_kw, isolate_trunk, beta_scale):
  model = nnx.merge(graphdef, params)
  out = model(batch['inputs'], batch['segment_ids'], isolate_trunk=isolate_trunk)
  return losses.mtp_d_loss(out.logits_BxTxV, out.mtp_logits_KxBxTxV, batch['targets'],
                           batch['segment_ids'], batch['target_segment_ids'],
                           beta_scale=beta_scale, **loss_kw)


def train_step(state: TrainState, batch, *, loss_kw, isolate_trunk, kl_warmup_steps, labels,
               schedule, skip_nonfinite):
  """One optimizer step; metrics come back unprefixed (`loss`, `mtp/k1/xent`, ...)."""
  beta_scale = (jnp.minimum(1.0, state.step / kl_warmup_steps) if kl_warmup_steps else 1.0)

  def loss_fn(params):
    # Frozen parameters get no gradient at all, so XLA drops their backward pass.
    params = jax.tree.map(lambda p, l: p if l == 'train' else jax.lax.stop_gradient(p), params, labels)
    return _forward_loss(params, state.graphdef, batch, loss_kw=loss_kw,
                         isolate_trunk=isolate_trunk, beta_scale=beta_scale)
  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
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
  labels = trainable_labels(shardings.params, config.train.trainable)
  kw = dict(loss_kw=loss_kwargs(config), isolate_trunk=config.mtp.isolate_trunk)
  batch_sh = NamedSharding(mesh, sharding.batch_spec(mesh))
  step_fn = jax.jit(functools.partial(train_step, **kw, labels=labels, schedule=learning_rate(config),
                                      kl_warmup_steps=config.distill.warmup_steps,
                                      skip_nonfinite=config.train.on_nan == 'skip'),
                    in_shardings=(shardings, batch_sh), out_shardings=(shardings, None),
                    donate_argnums=0)
  eval_fn = jax.jit(functools.partial(eval_step, **kw), in_shardings=(shardings, batch_sh))
  return step_fn, eval_fn


# ---------------------------------------------------------------------------------------------
# Data


def make_source(config: ml_collections.ConfigDict, split: str):
  """The train or held-out record source named by `config.data`."""
  d = config.data
  if d.source == 'synthetic':  # held-out records come from another seed of the same process
    return data.SyntheticSource(config.model.vocab_size, d.seq_len, d.synthetic_records,
                                seed=d.seed + (0 if split == 'train' else 1_000_003))
  if d.source == 'tokens':
    cut = 1.0 - d.eval_fraction
    return data.PackedTokens(d.train_path, d.seq_len, d.eos_id, config.model.vocab_size,
                             split=(0.0, cut) if split == 'train' else (cut, 1.0))
  raise ValueError(f"unknown data.source {d.source!r}; expected 'synthetic' or 'tokens'")


def make_data_iterator(config: ml_collections.ConfigDict, split: str):
  d = config.data
  return data.make_iterator(make_source(config, split), global_batch=d.batch_size, seed=d.seed,
                            shuffle=d.shuffle and split == 'train', process_index=jax.process_index(),
                            process_count=jax.process_count())


# ---------------------------------------------------------------------------------------------
# The loop


class _MetricsLog:
  """`metrics.jsonl` in the workdir (process 0 only), truncated to the resumed step on restart."""

  def __init__(self, path: str, resume_step: int):
    self.path = path
    self.enabled = jax.process_index() == 0
    if self.enabled and os.path.exists(path):
      with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)['step'] <= resume_step]
      with open(path, 'w') as f:
        f.writelines(kept)

  def write(self, record: dict[str, Any]) -> None:
    if self.enabled:
      with open(self.path, 'a') as f:
        f.write(json.dumps(record) + '\n')


def _to_host(metrics) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def evaluate_loss(config, state, eval_fn, mesh) -> dict[str, float]:
  """Mean metrics over `train.eval_batches` held-out batches (the same batches every time)."""
  it = make_data_iterator(config, 'eval')
  sums: dict[str, float] = {}
  for _ in range(config.train.eval_batches):
    m = _to_host(eval_fn(state, sharding.put_batch(next(it), mesh)))
    sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
  return {f'eval/{k}': v / config.train.eval_batches for k, v in sums.items()}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True):
  """Train (resuming from the latest checkpoint in `workdir`), checkpoint, evaluate; returns final metrics."""
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  if config.data.batch_size % sharding.data_parallel_size(mesh):
    raise ValueError(f'data.batch_size={config.data.batch_size} is not divisible by the '
                     f'{sharding.data_parallel_size(mesh)}-way data-parallel mesh axes')
  with jax.set_mesh(mesh):
    abstract, shardings = abstract_train_state(config, mesh)
    step_fn, eval_fn = make_steps(config, mesh, shardings)
    train_it = make_data_iterator(config, 'train')
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                   every_steps=config.ckpt.every_steps, max_to_keep=config.ckpt.max_to_keep)
    start = ckpt.latest_step()
    if start is None:
      state, start = init_train_state(config, abstract, shardings), 0
    else:
      state = ckpt.restore(start, abstract, train_it)
    if jax.process_index() == 0:
      with open(os.path.join(workdir, 'config.json'), 'w') as f:
        f.write(config.to_json(indent=2))
    log = _MetricsLog(os.path.join(workdir, 'metrics.jsonl'), start)
    tokens_per_step = config.data.batch_size * config.data.seq_len
    bar = _progress(progress, start, config.train.steps)
    pending, last_log = None, (start, time.perf_counter())

    def flush(step, metrics):  # host side of step `step` (1-based count of completed steps)
      nonlocal last_log
      m = _to_host(metrics)
      if not m.pop('finite'):
        good = [s for s in ckpt.all_steps() if s < step]
        raise FloatingPointError(f'non-finite loss or gradient at step {step}; last good checkpoint: '
                                 f'{good[-1] if good else None} (set train.on_nan=skip to drop such steps)')
      if step % config.train.log_every == 0 or step == config.train.steps:
        now = time.perf_counter()
        m['tokens_per_s'] = tokens_per_step * (step - last_log[0]) / max(now - last_log[1], 1e-9)
        last_log = (step, now)
        log.write({'step': step, **{f'train/{k}': v for k, v in m.items()}})
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
      bar.update(1)

    for step in range(start + 1, config.train.steps + 1):
      state, metrics = step_fn(state, sharding.put_batch(next(train_it), mesh))
      if pending is not None:
        flush(*pending)
      pending = (step, metrics)
      if ckpt.should_save(step) and step != config.train.steps:
        flush(*pending)  # never checkpoint a state that a non-finite step produced
        pending = None
        ckpt.save(step, state, train_it)
      if config.train.eval_every and step % config.train.eval_every == 0:
        log.write({'step': step, **evaluate_loss(config, state, eval_fn, mesh)})
    if pending is not None:
      flush(*pending)
    bar.close()
    if ckpt.latest_step() != config.train.steps:
      ckpt.save(config.train.steps, state, train_it)
    ckpt.close()
    final = evaluate_loss(config, state, eval_fn, mesh)
    log.write({'step': config.train.steps, **final})
    return state, final


def _progress(enabled: bool, start: int, total: int):
  import tqdm  # the terminal bar only; metrics.jsonl is the record
  return tqdm.tqdm(initial=start, total=total, disable=not enabled or jax.process_index() != 0,
                   dynamic_ncols=True, desc='train')


def restore_model(workdir: str) -> tuple[MTPTransformer, ml_collections.ConfigDict]:
  """The trained model of a workdir (latest checkpoint, parameters replicated) and its config."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{workdir} holds no config.json: not a training workdir')
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  config.mesh.shape, config.mesh.axes = (-1,), ('data',)
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, 'checkpoints'), every_steps=0, max_to_keep=1)
  step = ckpt.latest_step()
  if step is None:
    raise FileNotFoundError(f'{workdir} holds no checkpoint')
  abstract, _ = abstract_train_state(config, mesh)
  state = ckpt.restore(step, abstract)
  ckpt.close()
  return nnx.merge(state.graphdef, state.params), config
