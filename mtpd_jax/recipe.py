"""Config -> library arguments: validation, model shape, β_k, loss knobs, frozen groups, optimizer, data.

With train.py, the only reader of the ConfigDict; everything below it takes plain values.
"""

import math
import os
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx

from mtpd_jax import data, evaluate, losses, sharding
from mtpd_jax.model import ModelConfig
from mtpd_jax.moe import MoEConfig

BETA_SCHEDULES = ('constant', 'exp_decay', 'linear_decay', 'linear_increase')


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raise ValueError naming the first bad field, before any work starts."""
  m, d, k = config.model, config.distill, config.mtp.num_heads
  choices = {'distill.kl': (d.kl, losses.KL_DIRECTIONS), 'distill.teacher': (d.teacher, losses.TEACHERS),
             'distill.top_n_mode': (d.top_n_mode, losses.TOP_N_MODES),
             'distill.selection': (d.selection, losses.SELECTIONS),
             'distill.beta_schedule': (d.beta_schedule, BETA_SCHEDULES),
             'train.on_nan': (config.train.on_nan, ('stop', 'skip')),
             'train.init_heads': (config.train.init_heads, ('fresh', 'loop', 'trunk')),
             'train.resume': (config.train.resume, ('auto', 'never')),
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
  schedule = tuple(config.looped.schedule)
  if schedule and (schedule[0] < 1 or any(b <= a for a, b in zip(schedule, schedule[1:]))):
    raise ValueError(f'looped.schedule={schedule} must be increasing head counts starting at >= 1')
  if config.train.steps < 1:
    raise ValueError(f'train.steps={config.train.steps} must be >= 1')
  if config.train.loss_chunk_rows < 0:
    raise ValueError(f'train.loss_chunk_rows={config.train.loss_chunk_rows} must be >= 0 (0 = unchunked loss)')
  if not 0 <= config.eval.get('draft_vocab', 0) <= m.vocab_size:
    raise ValueError(f'eval.draft_vocab={config.eval.draft_vocab} must be in [0, model.vocab_size={m.vocab_size}]')
  if config.eval.draft_depth < 0:
    raise ValueError(f'eval.draft_depth={config.eval.draft_depth} must be >= 1 (or 0 for K)')
  if config.data.source not in ('synthetic', 'tokens', 'embedded'):
    raise ValueError(f"data.source={config.data.source!r} is not one of ('synthetic', 'tokens', 'embedded')")
  if config.data.source == 'tokens':
    if not os.path.isfile(config.data.train_path):
      raise FileNotFoundError(f'data.train_path={config.data.train_path!r} is not a file')
    make_source(config, 'train')  # reads the header and checks every id against the vocabulary
  _validate_gguf(config)
  for entry in config.eval.jsonl:
    path = entry.partition('=')[2].partition(':')[0]
    if '=' not in entry or not os.path.isfile(path):
      raise FileNotFoundError(f"eval.jsonl entry {entry!r}: expected 'name=path[:field]' naming an existing file")
  mesh_shape = sharding.resolve_mesh_shape(config.mesh.shape, config.mesh.axes,
                                           sharding.mesh_device_count(config.mesh.shape))
  data_parallel = math.prod(n for n, ax in zip(mesh_shape, config.mesh.axes) if ax in sharding.AXIS_RULES['batch'])
  if config.data.batch_size % data_parallel:
    raise ValueError(f'data.batch_size={config.data.batch_size} is not divisible by the {data_parallel}-way '
                     'data-parallel mesh axes')
  trainable_labels({}, config.train.trainable)  # raises on a bad value
  if isinstance(config.train.trainable, (list, tuple)) and not all(1 <= h <= k for h in config.train.trainable):
    raise ValueError(f'train.trainable={config.train.trainable!r}: head indices must lie in 1..{k}')
  moe = model_config(config).moe  # ModelConfig and MoEConfig check their own shape constraints
  if moe.num_experts and moe.group_size and config.data.seq_len % moe.group_size:
    raise ValueError(f'model.moe.group_size={moe.group_size} does not divide data.seq_len={config.data.seq_len}')


def _validate_gguf(config: ml_collections.ConfigDict) -> None:
  """A GGUF `train.init_from` must be a readable llama checkpoint of this model's shape; likewise the tokenizer."""
  from mtpd_jax import gguf_llama
  init_from, tok = config.train.init_from, config.data.tokenizer
  if gguf_llama.is_gguf(init_from):
    gguf_llama.check_model_config(config.model.to_dict(), init_from)
  elif init_from and config.train.init_heads == 'trunk':
    raise ValueError(f"train.init_heads='trunk' needs a GGUF train.init_from, not {init_from!r}")
  if tok != 'bpe':
    if not gguf_llama.is_gguf(tok):
      raise ValueError(f"data.tokenizer={tok!r} is not 'bpe', 'smollm2' or a .gguf path")
    if gguf_llama.load_tokenizer(tok).vocab_size > config.model.vocab_size:
      raise ValueError(f'data.tokenizer={tok!r} has {gguf_llama.load_tokenizer(tok).vocab_size} tokens, '
                       f'more than model.vocab_size={config.model.vocab_size}')


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  fields = config.model.to_dict()
  moe = fields.pop('moe', {})  # workdirs saved before MoE existed have no model.moe
  return ModelConfig(**fields, moe=MoEConfig(**moe), num_mtp_heads=config.mtp.num_heads)


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
              tau=d.tau, detach=d.detach, teacher=d.teacher, selection=d.selection)


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


def embedded_data(config: ml_collections.ConfigDict):
  """The embedded corpus and tokenizer (built once, then read from the cache)."""
  from mtpd_jax import corpus
  d = config.data
  return corpus.prepare_embedded(d.cache_dir or None, vocab_size=config.model.vocab_size,
                                 max_chars=d.embedded_chars, code_fraction=d.code_fraction,
                                 tokenizer=d.tokenizer)


def make_source(config: ml_collections.ConfigDict, split: str):
  """The train or held-out record source named by `config.data`."""
  d = config.data
  if d.source == 'synthetic':  # held-out records come from another seed of the same process
    return data.SyntheticSource(config.model.vocab_size, d.seq_len, d.synthetic_records,
                                seed=d.seed + (0 if split == 'train' else 1_000_003))
  if d.source not in ('tokens', 'embedded'):
    raise ValueError(f"unknown data.source {d.source!r}; expected 'synthetic', 'tokens' or 'embedded'")
  path, eos_id = (d.train_path, d.eos_id) if d.source == 'tokens' else (
      lambda e: (e.train_tokens_path, e.eos_id))(embedded_data(config))
  cut = 1.0 - d.eval_fraction
  return data.PackedTokens(path, d.seq_len, eos_id, config.model.vocab_size,
                           split=(0.0, cut) if split == 'train' else (cut, 1.0))


def make_data_iterator(config: ml_collections.ConfigDict, split: str):
  d = config.data
  return data.make_iterator(make_source(config, split), global_batch=d.batch_size, seed=d.seed,
                            shuffle=d.shuffle and split == 'train', process_index=jax.process_index(),
                            process_count=jax.process_count())


def prompt_sets(config: ml_collections.ConfigDict) -> dict[str, list[np.ndarray]]:
  """Named prompt sets (token-id arrays) for the decoding evaluation.

  `embedded`: the held-out `chat` (ShareGPT first turns, chat template), `code` (HumanEval) and
  `math` (CHAMP) sets named in `eval.prompt_sets`. `synthetic`: starts of held-out records.
  Extra sets come from `eval.jsonl` entries 'name=path' or 'name=path:field' (text needs the
  embedded tokenizer; a field of token ids works with any source).
  """
  from mtpd_jax import prompts
  e, source = config.eval, config.data.source
  tok = embedded_data(config).tokenizer() if source == 'embedded' else None
  sets = {}
  if source == 'synthetic':
    src = make_source(config, 'eval')
    sets['synthetic'] = [src[i]['inputs'][:e.max_prompt_tokens] for i in range(min(e.max_prompts, len(src)))]
  elif source == 'embedded':
    for name in e.prompt_sets:
      sets[name] = prompts.load_prompt_set(name, tokenizer=tok, max_prompts=e.max_prompts,
                                           max_prompt_tokens=e.max_prompt_tokens, chat_template=name == 'chat')
  for entry in e.jsonl:
    name, _, spec = entry.partition('=')
    path, _, field = spec.partition(':')
    sets[name] = evaluate.load_prompts(path, field or 'prompt', tokenize=tok and tok.encode, limit=e.max_prompts)
  if not sets:
    raise ValueError(f'no prompt sets for data.source={source!r}; name JSONL files in eval.jsonl')
  return sets
