"""Training runs from a config: the translation into the core's `train.TrainSpec`, warm starts,
and the workdir: what may resume in it, its saved config, and its trained model.
"""

import functools
import hashlib
import json
import os

import jax
import ml_collections
import numpy as np
from flax import nnx, traverse_util

from mtpd_jax import checkpoint, head_vocab, sharding, train, workdir_lock
from mtpd_jax.harness import export, pretrained, recipe, regenerate, trunk_cache, validation
from mtpd_jax.model import MTPTransformer

# Config fields that change the shape of the saved state: a workdir's checkpoints are only
# restorable by a config that agrees on all of them.
STATE_SHAPING_FIELDS = ('model', 'train.trainable')

# The only fields (or groups) that may differ when a run resumes: how long it runs (the learning
# rate schedule follows the new train.steps from the resumed step on), what it logs, when it
# checkpoints, how it is evaluated and laid out on devices, and how a sweep or looped run
# generates this run's config (its effect shows in the run's own fields). Any other difference
# changes the model, the loss or the data order, and a resume is refused.
MAY_CHANGE_ON_RESUME = ('train.steps', 'train.log_every', 'train.eval_every', 'train.eval_batches',
                        'train.on_nan', 'train.resume', 'train.loss_chunk_rows', 'eval', 'ckpt', 'mesh',
                        'data.cache_dir', 'train.trunk_cache_dir', 'seeds', 'base', 'looped')


def abstract_state(config: ml_collections.ConfigDict, mesh) -> tuple[train.TrainState, train.TrainState]:
  """`train.abstract_train_state` of the model, optimizer and trainable parameters `config` names."""
  return train.abstract_train_state(recipe.model_config(config), functools.partial(recipe.make_optimizer, config),
                                    config.train.trainable, mesh)


def init_state(config: ml_collections.ConfigDict, abstract: train.TrainState,
               shardings: train.TrainState) -> train.TrainState:
  return train.init_train_state(recipe.model_config(config), config.seed, abstract, shardings)


def make_steps(config: ml_collections.ConfigDict, mesh, shardings: train.TrainState):
  """`train.make_steps` with the step settings, schedule and trainable parameters of `config`."""
  return train.make_steps(recipe.step_config(config), recipe.learning_rate(config), config.train.trainable,
                          mesh, shardings)


def train_spec(config: ml_collections.ConfigDict, *, progress: bool = True) -> train.TrainSpec:
  """The core's whole view of a run, read from `config` (validated first) once."""
  validation.validate_config(config)
  mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
  if config.data.regenerate:  # the training text: the init_from model's own answers, decoded once
    regenerate.build(config, functools.partial(answering_model, config), progress=progress)
  ids = recipe.head_vocab_ids(config)
  cache = recipe.make_trunk_cache(config, ids)
  prepare = None
  if cache:  # the frozen trunk's states, built once for every run on this trunk and data
    sources = lambda: {s: recipe.make_source(config, s) for s in trunk_cache.SPLITS}
    prepare = lambda state: cache.build(state.graphdef, state.params, sources(), progress=progress)
  return train.TrainSpec(
      model=recipe.model_config(config), seed=config.seed, trainable=config.train.trainable,
      optimizer=functools.partial(recipe.make_optimizer, config), schedule=recipe.learning_rate(config),
      step=recipe.step_config(config, ids), loop=recipe.loop_config(config), mesh=mesh,
      batches=lambda split: recipe.make_data_iterator(config, split, cache),
      config_json=config.to_json(indent=2), check_workdir=functools.partial(check_workdir, config),
      warm_start=functools.partial(warm_start, config, mesh=mesh) if config.train.init_from else None,
      prepare=prepare, checkpoint_meta=None if ids is None else recipe.head_vocab_meta(ids))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True):
  """Train `config` in `workdir` (resuming from its newest checkpoint), checkpoint, evaluate.

  Returns (state, held-out metrics); see `train.fit`.
  """
  return train.fit(train_spec(config, progress=progress), workdir, progress=progress)


def train_plan(plan: list[tuple[ml_collections.ConfigDict, str]], *, progress: bool = True):
  """Train each (config, workdir) of a plan in order, resuming or skipping what is done: a looped
  run's stages, or a sweep point's models (`experiment.training_plans`), some of which another
  point may be training in another process (then this one waits for it). Returns the last
  (state, final metrics).
  """
  result = None
  for config, workdir in plan:
    if len(plan) > 1:
      print(f'[looped] {config.model.num_mtp_heads} heads -> {workdir}', flush=True)
    with workdir_lock.hold(workdir, wait=True):
      result = train_and_evaluate(config, workdir, progress=progress)
  return result


# ---------------------------------------------------------------------------------------------
# Warm starts


def answering_model(config: ml_collections.ConfigDict) -> MTPTransformer:
  """train.init_from's model without heads: the main head that regenerated text answers with."""
  if pretrained.is_pretrained(config.train.init_from):
    return pretrained.load_model(config.train.init_from, num_mtp_heads=0)
  return restore_model(config.train.init_from)[0]


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


def warm_start(config: ml_collections.ConfigDict, abstract: train.TrainState, shardings: train.TrainState, *,
               mesh) -> train.TrainState:
  """A fresh state whose parameters come from `train.init_from`, with fresh optimizer moments.

  `init_from` is a training workdir, a pretrained checkpoint (pretrained.py: a llama GGUF file,
  'smollm2', or 'hf:<Hugging Face folder>'), or a folder of exported heads (export.py: its base
  model, then its heads). Parameters it lacks (new MTP heads) get the fresh initialisation, which
  is not even built when it has them all (a looped stage copies every new head).
  """
  fresh = lambda: init_state(config, abstract, shardings).params
  init_from = config.train.init_from
  source = export.base_of(init_from) if export.is_export(init_from) else init_from
  if pretrained.is_pretrained(source):
    params = pretrained.init_params(abstract.graphdef, fresh(), source,
                                    trunk_heads=config.train.init_heads == 'trunk')
  else:
    model, _ = restore_model(source, mesh)
    saved = (checkpoint_meta(source) or {}).get('head_vocab')
    if saved is not None and source == init_from:  # heads trained over other ids would draft the wrong ones
      train.check_meta({'head_vocab': saved}, recipe.head_vocab_meta(recipe.head_vocab_ids(config)) if
                       config.mtp.head_vocab else None, f'train.init_from={source}')
    params = transplant(abstract.params, nnx.state(model, nnx.Param),
                        loop_heads=config.train.init_heads == 'loop')
    missing = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    if any(missing(x) for x in jax.tree.leaves(params)):
      params = jax.tree.map(lambda p, f: f if missing(p) else p, params, fresh())
  if source != init_from:  # the exported heads, onto the base they were trained on
    params = export.load_heads(params, init_from, recipe.model_config(config), recipe.head_vocab_ids(config))
  return train.state_from_params(params, abstract, shardings)


# ---------------------------------------------------------------------------------------------
# Workdirs


def _get(tree: dict, dotted: str):
  for key in dotted.split('.'):
    tree = tree.get(key) if isinstance(tree, dict) else None
  return tree


def with_defaults(saved: dict, defaults: dict) -> dict:
  """`saved` with every key it lacks taken from `defaults`, recursively (configs of older versions)."""
  out = dict(defaults)
  for k, v in saved.items():
    out[k] = with_defaults(v, defaults[k]) if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
  return out


def _flatten(x, prefix: str) -> dict:
  """{'prefix.a.b': value} of a nested dict (a leaf: {prefix: x})."""
  if not isinstance(x, dict):
    return {prefix: x}
  return {f'{prefix}.{k}' if prefix else k: v for k, v in traverse_util.flatten_dict(x, sep='.').items()}


def state_mismatch(saved: dict, current: dict) -> list[str]:
  """'field: saved -> current' for every state-shaping field on which two configs differ."""
  diffs = []
  for field in STATE_SHAPING_FIELDS:
    a, b = _flatten(_get(saved, field), field), _flatten(_get(current, field), field)
    diffs += [f'{k}: {a.get(k)!r} -> {b.get(k)!r}' for k in sorted(set(a) | set(b))
              if json.dumps(a.get(k)) != json.dumps(b.get(k))]
  return diffs


def _inactive(flat: dict, key: str) -> bool:
  """Fields that do nothing in this config: the MTP/distillation knobs of a plain LM (K = 0) or of
  an MTP run without distillation."""
  no_heads = not flat.get('model.num_mtp_heads')
  if key.startswith('mtp.'):
    return no_heads
  if key.startswith('distill.') and key != 'distill.enabled':
    return no_heads or not flat.get('distill.enabled')
  return False


def resume_mismatch(saved: dict, current: dict) -> list[str]:
  """'field: saved -> current' for every field that differs and must not change on resume."""
  a, b = _flatten(saved, ''), _flatten(current, '')
  may = lambda k: any(k == f or k.startswith(f + '.') for f in MAY_CHANGE_ON_RESUME)
  return [f'{k}: {a.get(k)!r} -> {b.get(k)!r}' for k in sorted(set(a) | set(b))
          if json.dumps(a.get(k)) != json.dumps(b.get(k)) and not may(k)
          and not (_inactive(a, k) and _inactive(b, k))]


def has_checkpoints(workdir: str) -> bool:
  ckpt_dir = os.path.join(workdir, train.CHECKPOINTS)
  return os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))


def check_workdir(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuse a workdir whose checkpoints this config must not touch: another model, a resume that
  would change the loss or the data order (MAY_CHANGE_ON_RESUME lists what may change),
  checkpoints without the config.json that says what they are, or any reuse under resume=never."""
  if not has_checkpoints(workdir):
    return
  if config.train.resume == 'never':
    raise ValueError(f'train.resume=never, but {workdir} already holds checkpoints; choose a fresh --workdir')
  if not os.path.exists(os.path.join(workdir, train.CONFIG_JSON)):
    raise ValueError(f'{workdir} holds checkpoints but no config.json, so nothing says which model they '
                     'belong to; put its config.json back or use another --workdir')
  current = json.loads(config.to_json())
  # A field the saved run's version lacked is compared as this config has it.
  saved = with_defaults(saved_config(workdir).to_dict(), current)
  diffs = state_mismatch(saved, current)
  if diffs:
    raise ValueError(f'{workdir} holds checkpoints of another model ({"; ".join(diffs)}); use another --workdir')
  diffs = resume_mismatch(saved, current)
  if diffs:
    raise ValueError(f'{workdir} holds a run with other settings ({"; ".join(diffs)}); resume it with its own '
                     'settings (only logging, evaluation, checkpoint, mesh and train.steps may change) '
                     'or use another --workdir')


def saved_config(workdir: str, defaults: ml_collections.ConfigDict | None = None) -> ml_collections.ConfigDict:
  """The config.json of a workdir, which holds the fully resolved config of its run.

  `defaults` (an entry point passes configs/base.py's) fill the fields that a workdir of an older
  version lacks.
  """
  path = os.path.join(workdir, train.CONFIG_JSON)
  if not os.path.exists(path):
    raise FileNotFoundError(f'{workdir} holds no config.json: not a training workdir')
  with open(path) as f:
    try:
      saved = json.load(f)
    except ValueError as e:
      raise ValueError(f'{path} is not valid JSON ({e}); restore it from a copy or use another --workdir') from None
  if not isinstance(saved, dict):
    raise ValueError(f'{path} holds {type(saved).__name__}, not a config')
  saved = validation.with_current_names(saved)
  if defaults is not None:
    saved = with_defaults(saved, json.loads(defaults.to_json()))
  return ml_collections.ConfigDict(saved)


def checkpoint_meta(workdir: str) -> dict | None:
  """The meta saved with a workdir's latest checkpoint (`train.TrainSpec.checkpoint_meta`)."""
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, train.CHECKPOINTS), every_steps=0, max_to_keep=1)
  try:
    step = ckpt.latest_step()
    return None if step is None else ckpt.restore_meta(step)
  finally:
    ckpt.close()


def head_vocab_of(workdir: str, config: ml_collections.ConfigDict) -> np.ndarray | None:
  """The head vocabulary a workdir's heads were trained over, as saved with its checkpoint (None:
  all of V). A config that names one whose checkpoint lacks it, or holds another size, is refused."""
  saved = (checkpoint_meta(workdir) or {}).get('head_vocab')
  size = config.mtp.head_vocab
  if size and saved is None:
    raise ValueError(f'{workdir}: its config says mtp.head_vocab={size}, but its checkpoint holds no head '
                     'vocabulary, so nothing says which ids its heads draft; retrain it')
  if saved is None:
    return None
  ids = head_vocab.check_ids(saved['ids'], config.model.vocab_size)
  if len(ids) != size or hashlib.sha256(ids.astype(np.int64).tobytes()).hexdigest() != saved['sha256']:
    raise ValueError(f'{workdir}: its checkpoint\'s head vocabulary ({len(ids)} ids) does not match its '
                     f'config (mtp.head_vocab={size}) or its own checksum; the checkpoint is damaged')
  return ids


def restore_model(workdir: str, mesh=None, defaults: ml_collections.ConfigDict | None = None
                  ) -> tuple[MTPTransformer, ml_collections.ConfigDict]:
  """The trained model of a workdir (latest checkpoint) and its config.

  Parameters are placed on `mesh` by the logical axis rules (default: replicated on all devices).
  """
  config = saved_config(workdir, defaults)
  mesh = mesh or sharding.make_mesh((-1,), ('data',))
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, train.CHECKPOINTS), every_steps=0, max_to_keep=1)
  step = ckpt.latest_step()
  if step is None:
    raise FileNotFoundError(f'{workdir} holds no checkpoint')
  abstract, _ = abstract_state(config, mesh)
  try:
    state = ckpt.restore_named(step, abstract)
  finally:
    ckpt.close()
  return nnx.merge(state.graphdef, state.params), config
