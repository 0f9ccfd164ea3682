"""The core of training: TrainState, the jitted train and eval steps, and the training loop.

Nothing here reads a config: the harness (mtpd_jax/harness/training.py) translates one, once, into
the frozen dataclasses below (`TrainSpec`, `StepConfig`, `LoopConfig`, the model's `ModelConfig`
and the loss's `losses.LossConfig`) and calls `fit`.

The loop dispatches step t, then pulls step t-1's metrics to the host, so the host never waits on
the device except at logging, checkpointing and evaluation points.
"""

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtpd_jax import checkpoint, fused_loss, head_vocab, losses, moe, runtime, sharding, workdir_lock
from mtpd_jax.model import ModelConfig, MTPTransformer


# What `fit` writes into a workdir; the harness reads a workdir by these names.
CHECKPOINTS = 'checkpoints'      # orbax checkpoints of the state and the data iterator
CONFIG_JSON = 'config.json'      # the run's complete config, as the harness gave it
METRICS = 'metrics.jsonl'        # a line per logged step and per held-out evaluation


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState
  graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)


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


# State creation (abstract first, then a sharded jit init)


def abstract_train_state(model_cfg: ModelConfig, optimizer: Callable[[Any], optax.GradientTransformation],
                         trainable, mesh) -> tuple[TrainState, TrainState]:
  """TrainState of ShapeDtypeStructs (carrying shardings) and the tree of NamedShardings.

  `optimizer` maps the parameters' trainable labels to the optimizer (frozen ones get none).
  """
  model = nnx.eval_shape(lambda: MTPTransformer(model_cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(model, nnx.Param)
  tx = optimizer(trainable_labels(abstract_params, trainable))
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  replicated = NamedSharding(mesh, P())
  param_sh = sharding.param_shardings(abstract_params, mesh)
  opt_sh = sharding.like_params_shardings(abstract_opt, abstract_params, param_sh, mesh)
  shardings = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, graphdef=graphdef, tx=tx)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                                     opt_state=abstract_opt, graphdef=graphdef, tx=tx), shardings)
  return abstract, shardings


def init_train_state(model_cfg: ModelConfig, seed: int, abstract: TrainState, shardings: TrainState) -> TrainState:
  """A freshly initialised TrainState, each array created directly in its sharding."""

  def init():
    _, params = nnx.split(MTPTransformer(model_cfg, rngs=nnx.Rngs(seed)), nnx.Param)
    return params, abstract.tx.init(params)
  params, opt_state = jax.jit(init, out_shardings=(shardings.params, shardings.opt_state))()
  step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
  return abstract.replace(step=step, params=params, opt_state=opt_state)


def state_from_params(params: nnx.State, abstract: TrainState, shardings: TrainState) -> TrainState:
  """Step 0 with these parameters (copied, in their shardings) and fresh optimizer moments."""
  # A fresh buffer per parameter: looped heads copied from one source must not alias one donated buffer.
  params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings.params)(params)
  return abstract.replace(step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step), params=params,
                          opt_state=jax.jit(abstract.tx.init, out_shardings=shardings.opt_state)(params))


# ---------------------------------------------------------------------------------------------
# Steps


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """What the train and eval steps compute besides the parameter update.

  loss_chunk_rows > 0 computes the loss from hidden states in row chunks (fused_loss), which
  must implement `loss` (`fused_loss.supports`); 0 computes it on full logits (losses.mtp_d_loss).
  kl_warmup_steps ramps every β_k linearly from 0; skip_nonfinite keeps the old parameters and
  moments where a step's loss or gradient is not finite. head_vocab: token ids that the heads'
  output layer is restricted to (head_vocab.py; () = all of V); their loss reads the heads'
  logits over those ids and the main head's whole, or a batch's cached teacher (`teacher_*`
  keys), so loss_chunk_rows does not apply to it.
  """
  loss: losses.LossConfig = losses.LossConfig()
  isolate_trunk: bool = False
  kl_warmup_steps: int = 0
  loss_chunk_rows: int = 0
  skip_nonfinite: bool = False
  head_vocab: tuple[int, ...] = ()

  def __post_init__(self):
    if self.loss_chunk_rows and not fused_loss.supports(self.loss):
      raise ValueError(f'train.loss_chunk_rows={self.loss_chunk_rows}: the fused loss supports teacher=main, '
                       f'detach=True and selection=threshold (got teacher={self.loss.teacher!r}, '
                       f'detach={self.loss.detach}, selection={self.loss.selection!r}); set '
                       'train.loss_chunk_rows=0 for the loss on full logits')


def fused_grad_flags(labels) -> dict[str, bool]:
  """Which gradients the fused loss must form, from the 'train'/'frozen' labels of the parameters:
  the unembedding's only if it trains, the main head's row only if something below it trains."""
  top = {}
  for path, label in jax.tree_util.tree_leaves_with_path(labels):
    name = getattr(path[0], 'key', None)
    top[name] = top.get(name, False) or label == 'train'
  below_main = [trains for name, trains in top.items() if name not in ('mtp_heads', 'unembed')]
  return dict(w_grad=top.get('unembed', top.get('embed', True)), main_grad=any(below_main))


def forward_loss(params, graphdef, batch, cfg: StepConfig, *, beta_scale, move_router_biases=False,
                 grad_flags=None):
  """(loss, (metrics, router biases)) of one batch; MoE adds its router terms.

  The router biases (moe.RouterBias) are those after the forward: moved by their balancing step
  with `move_router_biases`, as they came otherwise; an empty State for a dense model.
  """
  model = nnx.merge(graphdef, params)
  out = model(batch['inputs'], batch['segment_ids'], isolate_trunk=cfg.isolate_trunk,
              trunk_hidden_BxTxD=batch.get('trunk_hidden'),  # a frozen trunk's cached states
              move_router_biases=move_router_biases)
  labels = (batch['targets'], batch['segment_ids'], batch['target_segment_ids'])
  if cfg.head_vocab:
    loss, metrics = _head_vocab_loss(model, out, batch, labels, cfg, beta_scale)
  elif cfg.loss_chunk_rows:
    # The loss reads the final-normed hidden states and the unembedding in row chunks; the model's
    # logits go unused and XLA drops them, so no [K+1, B, T, V] array is materialised.
    w_DxV = model.embed[...].T if model.cfg.tie_embeddings else model.unembed[...]
    loss, metrics = fused_loss.mtp_d_loss_fused(model.final_norm(out.hidden_K1xBxTxD), w_DxV, *labels, cfg.loss,
                                                beta_scale=beta_scale, chunk_rows=cfg.loss_chunk_rows,
                                                **(grad_flags or {}))
  else:
    loss, metrics = losses.mtp_d_loss(out.logits_BxTxV, out.mtp_logits_KxBxTxV, *labels, cfg.loss,
                                      beta_scale=beta_scale)
  # MoE: + the router's balancing loss and moe/* load metrics.
  loss, metrics = moe.add_router_terms(loss, metrics, out.aux)
  return loss, (metrics, nnx.state(model, moe.RouterBias))


def _head_vocab_loss(model: MTPTransformer, out, batch, labels, cfg: StepConfig, beta_scale):
  """The main head's cross-entropy plus the heads' loss over the head vocabulary (head_vocab.py)."""
  ids_U = jnp.asarray(cfg.head_vocab, jnp.int32)
  mask_BxT = losses.target_mask(labels[1], labels[2], 0)
  if 'teacher_idx' in batch:  # a frozen trunk's cached teacher: the main logits are never formed
    teacher = head_vocab.Teacher.from_batch(batch)
    main_xent = -losses.masked_mean(teacher.target_logp_BxT, mask_BxT)
  else:
    teacher = head_vocab.teacher(out.logits_BxTxV, labels[0], ids_U, n=cfg.loss.top_n, tau=cfg.loss.tau)
    main_xent = losses.masked_mean(losses.xent(out.logits_BxTxV, labels[0]), mask_BxT)
  w_DxV = model.embed[...].T if model.cfg.tie_embeddings else model.unembed[...]
  x_KxBxTxD = model.final_norm(out.hidden_K1xBxTxD[1:])
  loss, metrics = head_vocab.mtp_loss(x_KxBxTxD, jnp.take(w_DxV, ids_U, axis=1), teacher, *labels, ids_U,
                                      model.cfg.vocab_size, cfg.loss, beta_scale=beta_scale)
  return main_xent + loss, {'xent': main_xent, **metrics, 'loss': main_xent + loss}


def train_step(state: TrainState, batch, *, cfg: StepConfig, labels, schedule: optax.Schedule):
  """One optimizer step; metrics come back unprefixed (`loss`, `mtp/k1/xent`, ...)."""
  beta_scale = (jnp.minimum(1.0, state.step / cfg.kl_warmup_steps) if cfg.kl_warmup_steps else 1.0)

  def loss_fn(params):
    # Frozen parameters get no gradient at all, so XLA drops their backward pass.
    params = jax.tree.map(lambda p, l: p if l == 'train' else jax.lax.stop_gradient(p), params, labels)
    return forward_loss(params, state.graphdef, batch, cfg, beta_scale=beta_scale, move_router_biases=True,
                        grad_flags=fused_grad_flags(labels))
  (_, (metrics, biases)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # MoE with bias balancing: each router bias steps toward even load (it has zero gradient).
  params = moe.keep_moved_biases(params, state.params, biases, labels)
  metrics['grad_norm'] = optax.global_norm(grads)
  metrics['lr'] = schedule(state.step)
  finite = jnp.isfinite(metrics['loss']) & jnp.isfinite(metrics['grad_norm'])
  metrics['finite'] = finite
  if cfg.skip_nonfinite:  # keep the old params and moments; the step counter still advances
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                     (params, opt_state), (state.params, state.opt_state))
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(state: TrainState, batch, *, cfg: StepConfig):
  _, (metrics, _) = forward_loss(state.params, state.graphdef, batch, cfg, beta_scale=1.0)
  return metrics


def make_steps(cfg: StepConfig, schedule: optax.Schedule, trainable, mesh, shardings: TrainState):
  """The one jitted train step (sharded, donating the state) and the jitted eval step."""
  labels = trainable_labels(shardings.params, trainable)
  batch_sh = NamedSharding(mesh, sharding.batch_spec(mesh))
  step_fn = jax.jit(functools.partial(train_step, cfg=cfg, labels=labels, schedule=schedule),
                    in_shardings=(shardings, batch_sh), out_shardings=(shardings, None), donate_argnums=0)
  eval_fn = jax.jit(functools.partial(eval_step, cfg=cfg), in_shardings=(shardings, batch_sh))
  return step_fn, eval_fn


# ---------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """How long the loop runs, and when it logs, evaluates and checkpoints."""
  steps: int
  log_every: int = 50
  eval_every: int = 0         # 0: only at the end
  eval_batches: int = 1
  ckpt_every: int = 0         # 0: only at the end (and on preemption)
  max_to_keep: int = 1
  tokens_per_step: int = 0    # for the logged tokens_per_s
  raise_on_nan: bool = True   # else a non-finite step is logged (and skipped: StepConfig.skip_nonfinite)


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  """Everything `fit` reads, built once from a config by the harness.

  `batches(split)`: host batches of 'train' (checkpointable) or 'eval' (the same batches on every
  call). `warm_start(abstract, shardings)`: a step-0 state when the workdir holds no checkpoint
  (None: a fresh initialisation from `seed`). `prepare(state)`: runs once the state is known,
  before the first step (the trunk-state cache builds there). `check_workdir(workdir)`: refuses
  checkpoints this run must not touch. `config_json`: the workdir's config.json, the record of
  what the run is. `checkpoint_meta`: a JSON dict saved with every checkpoint (a head vocabulary's
  ids); a resume whose checkpoint holds another one is refused.
  """
  model: ModelConfig
  seed: int
  trainable: Any
  optimizer: Callable[[Any], optax.GradientTransformation]
  schedule: optax.Schedule
  step: StepConfig
  loop: LoopConfig
  mesh: Mesh
  batches: Callable[[str], Iterator[dict]]
  config_json: str
  check_workdir: Callable[[str], None] = lambda workdir: None
  warm_start: Callable[[TrainState, TrainState], TrainState] | None = None
  prepare: Callable[[TrainState], None] | None = None
  checkpoint_meta: dict | None = None

  def abstract_state(self) -> tuple[TrainState, TrainState]:
    return abstract_train_state(self.model, self.optimizer, self.trainable, self.mesh)


def _to_host(metrics) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def evaluate_loss(state: TrainState, eval_fn, batches: Iterator[dict], num_batches: int, mesh) -> dict[str, float]:
  """Mean metrics over `num_batches` held-out batches."""
  sums: dict[str, float] = {}
  for _ in range(num_batches):
    m = _to_host(eval_fn(state, sharding.put_batch(next(batches), mesh)))
    sums = {k: sums.get(k, 0.0) + v for k, v in m.items()}
  return {f'eval/{k}': v / num_batches for k, v in sums.items()}


def check_meta(saved: dict | None, expected: dict | None, where: str) -> None:
  """Refuse a checkpoint whose meta (`TrainSpec.checkpoint_meta`) differs from this run's, naming the keys."""
  saved, expected = saved or {}, expected or {}
  diffs = sorted(k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k))
  if diffs:
    describe = lambda m, k: m[k].get('describe', 'other values') if isinstance(m.get(k), dict) else repr(m.get(k))
    raise ValueError(f'{where} was saved with another {", ".join(diffs)} ('
                     + '; '.join(f'{k}: {describe(saved, k)} there, {describe(expected, k)} here' for k in diffs)
                     + '); a model must keep its own: use its data and settings, or another --workdir')


def _resume_or_init(spec: TrainSpec, workdir, ckpt, abstract, shardings, train_it):
  """(state, step): the newest readable checkpoint of `workdir`, else a fresh (or warm) start."""
  spec.check_workdir(workdir)
  if ckpt.all_steps():
    step, state = ckpt.restore_latest_good(abstract, train_it)
    if step is not None:
      check_meta(ckpt.restore_meta(step), spec.checkpoint_meta, f'checkpoint {step} in {workdir}')
      return state, step
  if spec.warm_start:
    return spec.warm_start(abstract, shardings), 0
  return init_train_state(spec.model, spec.seed, abstract, shardings), 0


def fit(spec: TrainSpec, workdir: str, *, progress: bool = True):
  """Train (resuming from the newest checkpoint in `workdir`), checkpoint, evaluate.

  Returns (state, held-out metrics). SIGTERM/SIGINT checkpoint after the current step and raise
  runtime.Preempted; a non-finite step raises FloatingPointError (or is logged and skipped).
  """
  loop, mesh = spec.loop, spec.mesh
  started = time.perf_counter()  # every metrics line carries the seconds since: curves against wall time
  checkpoint.check_options(loop.ckpt_every, loop.max_to_keep)
  with workdir_lock.hold(workdir), jax.set_mesh(mesh), runtime.PreemptionGuard() as guard:
    abstract, shardings = spec.abstract_state()
    step_fn, eval_fn = make_steps(spec.step, spec.schedule, spec.trainable, mesh, shardings)
    train_it = spec.batches('train')
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, CHECKPOINTS), every_steps=loop.ckpt_every,
                                   max_to_keep=loop.max_to_keep)
    ckpt.check_free_space(abstract)
    # A restored data iterator starts reading (prefetching) at once, and its batches may read what
    # `prepare` builds from the state (the trunk-state cache): then it is rewound only after that.
    state, start = _resume_or_init(spec, workdir, ckpt, abstract, shardings, None if spec.prepare else train_it)
    if spec.prepare:
      spec.prepare(state)
      if start:
        ckpt.restore_data(start, train_it)
    log = runtime.MetricsLog(os.path.join(workdir, METRICS), start)  # may refuse: before config.json
    write = lambda step, record: log.write({'step': step, 'elapsed_s': round(time.perf_counter() - started, 2),
                                            **record})
    if jax.process_index() == 0:
      runtime.write_atomically(os.path.join(workdir, CONFIG_JSON), spec.config_json)
    held_out = lambda s: evaluate_loss(s, eval_fn, spec.batches('eval'), loop.eval_batches, mesh)
    bar = runtime.progress_bar(progress, start, loop.steps)
    pending, last_log = None, (start, time.perf_counter())

    def flush(step, metrics):  # host side of step `step` (1-based count of completed steps)
      nonlocal last_log
      m = _to_host(metrics)
      if not m.pop('finite'):
        if loop.raise_on_nan:
          good = [s for s in ckpt.all_steps() if s < step]
          raise FloatingPointError(f'non-finite loss or gradient at step {step}; last good checkpoint: '
                                   f'{good[-1] if good else None} (train.on_nan=skip drops such steps)')
        write(step, {'train/skipped_nonfinite': 1})
      if step % loop.log_every == 0 or step == loop.steps:
        now = time.perf_counter()
        m['tokens_per_s'] = loop.tokens_per_step * (step - last_log[0]) / max(now - last_log[1], 1e-9)
        last_log = (step, now)
        write(step, {f'train/{k}': v for k, v in m.items()})
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{m['tokens_per_s']:.0f}")
      bar.update(1)

    batch = sharding.put_batch(next(train_it), mesh) if start < loop.steps else None
    if batch is not None and jax.process_count() > 1:
      # Each process restores and compiles on its own; under load one can lag the other by more
      # than the 30 s within which gloo must set up a device group at a program's first run.
      # Compile first, then meet at a coordination-service barrier, which has no such deadline.
      step_fn = step_fn.lower(state, batch).compile()
      runtime.sync_processes('compiled')
    for step in range(start + 1, loop.steps + 1):
      batch = batch if batch is not None else sharding.put_batch(next(train_it), mesh)
      state, metrics = step_fn(state, batch)
      batch = None
      if pending is not None:
        flush(*pending)
      pending = (step, metrics)
      guard.step = step  # the multi-process sync point compares step numbers
      stop = guard.requested()
      if (ckpt.should_save(step) or stop) and step != loop.steps:
        flush(*pending)  # never checkpoint a state that a non-finite step produced
        pending = None
        ckpt.save(step, state, train_it, spec.checkpoint_meta)
        if stop:
          bar.close()
          ckpt.close()
          runtime.leave_together()
          raise runtime.Preempted(step, guard.signum)
      if loop.eval_every and step % loop.eval_every == 0:
        write(step, held_out(state))
    if pending is not None:
      flush(*pending)
    bar.close()
    if ckpt.latest_step() != loop.steps:
      ckpt.save(loop.steps, state, train_it, spec.checkpoint_meta)
    ckpt.close()
    final = held_out(state)
    write(loop.steps, final)
    return state, final
