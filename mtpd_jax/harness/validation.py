"""Config validation: every field against its rule, then what fields must agree on, the mesh and
the files a run will read, so that bad input stops before any work with one line naming it."""

import copy
import dataclasses
import functools
import math
import numbers
import os

import ml_collections
from flax import traverse_util

from mtpd_jax import data, decode, drafting, losses, sharding
from mtpd_jax.harness import corpus, export, pretrained, prompts, recipe, text_corpus, trunk_cache
from mtpd_jax.harness.rules import Rule, flag, integer, is_int, is_real, one_of, optional, real, text


# What every field of configs/base.py may hold. One rule per field, in base.py's order; a test
# fails when a field has none. Each rule is (doc, bad): `bad(value, config)` returns None for a
# good value, else what the value should be ('an int >= 1'), so the error names field, value and
# expectation. Bounds given as a field name ('model.vocab_size') are read from the same config.


def _beta(v, c):
  k = c.model.num_mtp_heads
  if v is None or (is_real(v) and v >= 0):
    return None
  if isinstance(v, (list, tuple)) and len(v) == k and all(is_real(b) and b >= 0 for b in v):
    return None
  if isinstance(v, (list, tuple)) and len(v) != k:
    return f'one value per head: {k} values for model.num_mtp_heads={k}'
  return (f'None or a finite number >= 0 (or one such number per head: {k} for '
          f'model.num_mtp_heads={k})')


def _trainable(v, c):
  k = c.model.num_mtp_heads
  if v == 'all' or (v == 'mtp_heads' and k >= 1):
    return None
  if (isinstance(v, (list, tuple)) and v and all(is_int(h) and 1 <= h <= k for h in v)
      and len(set(v)) == len(v)):
    return None
  return ("'all', 'mtp_heads' or a non-empty list of distinct head indices in "
          f'1..model.num_mtp_heads={k}' if k else "'all' (model.num_mtp_heads=0: there are no heads to train alone)")


def _increasing_heads(v, c):
  v = tuple(v) if isinstance(v, (list, tuple)) else v
  ok = v == () or (isinstance(v, tuple) and all(is_int(n) for n in v) and v[0] >= 1
                   and all(b > a for a, b in zip(v, v[1:])))
  return None if ok else 'increasing head counts starting at >= 1, e.g. (1, 2, 4, 8), or ()'


def _tree(v, c):
  v = tuple(v) if isinstance(v, (list, tuple)) else v
  ok = isinstance(v, tuple) and all(is_int(n) and n >= 1 for n in v)
  return None if ok else 'a tuple of branchings >= 1, one per draft depth, e.g. (3, 2, 1, 1), or ()'


def _mesh_shape(v, c):
  ok = isinstance(v, (list, tuple)) and v and all(is_int(n) and (n >= 1 or n == -1) for n in v) and (
      list(v).count(-1) <= 1)
  return None if ok else 'a tuple of sizes >= 1 with at most one -1 (the remaining devices)'


def _mesh_axes(v, c):
  ok = isinstance(v, (list, tuple)) and v and len(set(v)) == len(v) and all(a in sharding.MESH_AXES for a in v)
  return None if ok else f'distinct names from {sharding.MESH_AXES}'


def _prompt_sets(v, c):
  ok = isinstance(v, (list, tuple)) and all(name in corpus.PROMPT_SETS for name in v)
  return None if ok else f'a tuple of names from {corpus.PROMPT_SETS}'


def _rope_scaling(v, c):
  del c
  ok = isinstance(v, (list, tuple)) and (not v or (len(v) == 4 and all(
      isinstance(x, numbers.Real) and not isinstance(x, bool) and x > 0 for x in v)))
  return None if ok else '() or four positive numbers (factor, low_freq_factor, high_freq_factor, original context)'


def _jsonl(v, c):
  ok = isinstance(v, (list, tuple)) and all(
      isinstance(e, str) and e.partition('=')[0] and e.partition('=')[2] for e in v)
  return None if ok else "a tuple of 'name=path' or 'name=path:field' strings"


FIELD_RULES: dict[str, Rule] = {
    'seed': integer(0),
    'model.vocab_size': integer(2),
    'model.dim': integer(1),
    'model.num_layers': integer(1),
    'model.num_mtp_heads': integer(0),
    'model.num_heads': integer(1),
    'model.num_kv_heads': integer(1, 'model.num_heads'),
    'model.head_dim': integer(2),
    'model.mlp_dim': integer(1),
    'model.rope_base': real(0, lo_open=True),
    'model.rope_interleaved': flag(),
    'model.rope_scaling': Rule('() | (factor, low_freq_factor, high_freq_factor, original context), all > 0',
                               _rope_scaling),
    'model.attn_bias': flag(),
    'model.qk_norm': flag(),
    'model.tie_embeddings': flag(),
    'model.norm_eps': real(0, lo_open=True),
    'model.max_seq_len': integer(2),
    'model.dtype': one_of('float32', 'bfloat16'),
    'model.remat': flag(),
    'model.moe.num_experts': integer(0),
    'model.moe.top_k': integer(1),
    'model.moe.expert_dim': integer(0),
    'model.moe.num_shared_experts': integer(0),
    'model.moe.capacity_factor': real(),
    'model.moe.group_size': integer(0, 'data.seq_len'),
    'model.moe.renormalize_gates': flag(),
    'model.moe.aux_loss_weight': real(0),
    'model.moe.bias_update_rate': real(0),
    'mtp.ce_weight': real(0),
    'mtp.isolate_trunk': flag(),
    'mtp.head_vocab': integer(0, 'model.vocab_size'),
    'distill.enabled': flag(),
    'distill.detach': flag(),
    'distill.top_n': optional(integer(1, 'model.vocab_size')),
    'distill.top_n_mode': one_of(*losses.TOP_N_MODES),
    'distill.selection': one_of(*losses.SELECTIONS),
    'distill.renormalize': flag(),
    'distill.kl': one_of(*losses.KL_DIRECTIONS),
    'distill.divergence': one_of(*losses.DIVERGENCES),
    'distill.tau': real(0, lo_open=True),
    'distill.beta': Rule('None | finite number >= 0 | one per head', _beta),
    'distill.beta_schedule': one_of(*recipe.BETA_SCHEDULES),
    'distill.step_gamma': real(0, lo_open=True),
    'distill.teacher': one_of(*losses.TEACHERS),
    'distill.warmup_steps': integer(0),
    'data.source': one_of('synthetic', 'embedded', 'tokens', 'text'),
    'data.text_field': text(),
    'data.cache_dir': text(),
    'data.embedded_chars': integer(1),
    'data.code_fraction': real(0, 1),
    'data.tokenizer': text(),
    'data.train_path': text(),
    'data.eos_id': integer(0, below='model.vocab_size'),
    'data.eval_fraction': real(0, 1, lo_open=True, hi_open=True),
    'data.seq_len': integer(1, 'model.max_seq_len'),
    'data.batch_size': integer(1),
    'data.seed': integer(0),
    'data.shuffle': flag(),
    'data.synthetic_records': integer(1),
    'data.regenerate': flag(),
    'data.regenerate_temperature': real(0),
    'data.regenerate_new_tokens': integer(1),
    'data.regenerate_prompt_tokens': integer(1),
    'data.regenerate_batch_size': integer(1),
    'data.regenerate_prompts': integer(0),
    'train.steps': integer(1),
    'train.lr': real(0, lo_open=True),
    'train.b1': real(0, 1, hi_open=True),
    'train.b2': real(0, 1, hi_open=True),
    'train.eps': real(0),
    'train.weight_decay': real(0),
    'train.clip_norm': real(0, lo_open=True),
    'train.warmup_frac': real(0, 1),
    'train.min_lr_frac': real(0, 1),
    'train.trainable': Rule("'all' | 'mtp_heads' | non-empty list of head indices", _trainable),
    'train.init_from': text(),
    'train.init_heads': one_of('fresh', 'loop', 'trunk'),
    'train.resume': one_of('auto', 'never'),
    'train.on_nan': one_of('stop', 'skip'),
    'train.loss_chunk_rows': integer(0),
    'train.trunk_cache': flag(),
    'train.trunk_cache_dir': text(),
    'train.trunk_cache_dtype': one_of(*trunk_cache.DTYPES),
    'train.teacher_cache': flag(),
    'train.log_every': integer(1),
    'train.eval_every': integer(0),
    'train.eval_batches': integer(1),
    'looped.schedule': Rule('() | increasing head counts >= 1', _increasing_heads),
    'looped.stage_steps': integer(1),
    'base.steps': integer(0),
    'base.seed': integer(-1),
    'seeds': integer(1),
    'eval.enabled': flag(),
    'eval.prompt_sets': Rule(f'names from {corpus.PROMPT_SETS}', _prompt_sets),
    'eval.jsonl': Rule("'name=path[:field]' strings", _jsonl),
    'eval.chat_template': one_of('auto', 'on', 'off'),
    'eval.max_prompts': integer(1),
    'eval.max_prompt_tokens': integer(1),
    'eval.max_new_tokens': integer(1),
    'eval.draft_depth': integer(0),
    'eval.batch_size': integer(1),
    'eval.draft_vocab': integer(0, 'model.vocab_size'),
    'eval.draft_min_prob': real(0, 1),
    'eval.tree': Rule('() | branchings >= 1, one per draft depth', _tree),
    'eval.draft_source': one_of(*drafting.SOURCES),
    'eval.ngram': integer(1),
    'eval.repeats': integer(1),
    'eval.timing_steps': integer(1),
    'eval.timing_repeats': integer(1),
    'eval.latency_prompts': integer(0),
    'eval.speculation': one_of('', 'auto'),
    'eval.calibration_prompts': integer(1),
    'ckpt.every_steps': integer(0),
    'ckpt.max_to_keep': integer(1),
    'mesh.shape': Rule('sizes >= 1, at most one -1', _mesh_shape),
    'mesh.axes': Rule(f'distinct names from {sharding.MESH_AXES}', _mesh_axes),
}


# Fields renamed since some workdir's config.json was written: old name -> new name. A saved config
# is read under the new names (training.saved_config); a config or an override that sets an old
# name is refused with the new one. K had two names, the config's `mtp.num_heads` and the core's
# `num_mtp_heads` (beside the attention heads' `num_heads`): it is now the core's, in config.model.
RENAMED = {'mtp.num_heads': 'model.num_mtp_heads'}


def with_current_names(saved: dict) -> dict:
  """A saved config (nested dicts) with every field of RENAMED under its new name."""
  out = copy.deepcopy(saved)
  for old, new in RENAMED.items():
    *parents, leaf = old.split('.')
    node = functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, parents, out)
    if isinstance(node, dict) and leaf in node:
      *parents, new_leaf = new.split('.')
      functools.reduce(lambda d, k: d.setdefault(k, {}), parents, out)[new_leaf] = node.pop(leaf)
  return out


def check_fields(config: ml_collections.ConfigDict) -> None:
  """Every field against its rule in FIELD_RULES; a field no rule knows is refused as a likely typo."""
  for name, value in traverse_util.flatten_dict(config.to_dict(), sep='.').items():
    if name in RENAMED:
      raise ValueError(f'{name} is now {RENAMED[name]}; set that instead')
    if name not in FIELD_RULES:
      raise ValueError(f'{name}={value!r} is not a field of configs/base.py (validation.FIELD_RULES has no rule for it)')
    should = FIELD_RULES[name].bad(value, config)
    if should is not None:
      raise ValueError(f'{name}={value!r} must be {should}')


def validate_config(config: ml_collections.ConfigDict, *, mesh: bool = True) -> None:
  """Raise ValueError (OSError for a missing file) naming the first bad field or file, before any work.

  Every field against FIELD_RULES, then what fields must agree on, then (with `mesh`) the device
  mesh, then the files the run will read.
  """
  check_fields(config)
  _check_cross_fields(config)
  if mesh:
    _check_mesh(config)
  _check_files(config)


def _check_cross_fields(config: ml_collections.ConfigDict) -> None:
  m, d, e, k = config.model, config.data, config.eval, config.model.num_mtp_heads
  if m.num_heads % m.num_kv_heads:
    raise ValueError(f'model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}')
  if m.head_dim % 2:
    raise ValueError(f'model.head_dim={m.head_dim} must be even (RoPE rotates pairs of dimensions)')
  if m.moe.num_experts and m.moe.top_k > m.moe.num_experts:
    raise ValueError(f'model.moe.top_k={m.moe.top_k} must lie in 1..model.moe.num_experts={m.moe.num_experts}')
  if m.moe.num_experts and m.moe.group_size and d.seq_len % m.moe.group_size:
    raise ValueError(f'model.moe.group_size={m.moe.group_size} does not divide data.seq_len={d.seq_len}')
  recipe.step_config(config)  # β per head after its schedule; a fused loss that supports the settings
  if d.source == 'tokens' and not d.train_path:
    raise ValueError("data.source='tokens' needs data.train_path, a 1-D .npy file of token ids")
  if d.source == 'text' and not d.train_path:
    raise ValueError("data.source='text' needs data.train_path, a .jsonl or .txt file")
  if e.chat_template == 'on' and e.jsonl and d.source not in ('embedded', 'text'):
    raise ValueError("eval.chat_template='on' needs a tokenizer with a chat format; only "
                     "data.source='embedded' or 'text' has one")
  if config.train.trunk_cache and config.train.trainable == 'all':
    raise ValueError("train.trunk_cache=True needs a frozen trunk (train.trainable='mtp_heads' or head "
                     "indices); with trainable='all' the trunk's states change every step")
  if config.train.trunk_cache and m.moe.num_experts:
    raise ValueError('train.trunk_cache=True is not supported for MoE models yet (the trunk routers\' '
                     'balancing terms would be missing from the loss); set it to False')
  if config.train.teacher_cache and not (config.train.trunk_cache and config.mtp.head_vocab):
    raise ValueError('train.teacher_cache=True caches the frozen main head over the head vocabulary: it needs '
                     'train.trunk_cache=True and mtp.head_vocab > 0')
  if config.mtp.head_vocab and config.distill.enabled and (
      config.distill.teacher != 'main' or config.distill.top_n_mode != 'teacher' or not config.distill.detach):
    raise ValueError("mtp.head_vocab > 0 distils from the detached main head's own Top-N: it needs "
                     "distill.teacher='main', distill.top_n_mode='teacher' and distill.detach=True")
  if config.mtp.head_vocab and e.draft_vocab and e.draft_vocab != config.mtp.head_vocab:
    raise ValueError(f'eval.draft_vocab={e.draft_vocab}: heads trained over mtp.head_vocab={config.mtp.head_vocab} '
                     'ids draft among those; leave eval.draft_vocab=0 (or set it equal)')
  if d.regenerate and (d.source != 'embedded' or not config.train.init_from):
    raise ValueError("data.regenerate=True decodes the model's own answers: it needs data.source='embedded' "
                     'and a train.init_from (the model that answers)')
  heads = tuple(config.looped.schedule)[-1] if config.looped.schedule else k
  if e.enabled and e.draft_depth and not heads:
    raise ValueError(f'eval.draft_depth={e.draft_depth} drafts with MTP heads, '
                     'but model.num_mtp_heads=0')
  if e.draft_source != 'heads' and (e.tree or (e.draft_source == 'context' and e.draft_min_prob)):
    raise ValueError(f'eval.draft_source={e.draft_source!r} drafts chains from the context, without a tree '
                     f"({'eval.tree' if e.tree else 'or eval.draft_min_prob'}); leave those at their defaults")
  if e.tree and len(e.tree) != (e.draft_depth or heads):
    raise ValueError(f'eval.tree={tuple(e.tree)} has {len(e.tree)} depths, but decoding drafts '
                     f'{e.draft_depth or heads} (eval.draft_depth, or the number of heads)')


def check_decoding_fits(config: ml_collections.ConfigDict) -> None:
  """The entry points' check that the longest prompt and its generation fit model.max_seq_len.

  Not part of validate_config: the library's decoding does not need it (RoPE has no table), and
  small test configs decode past a short max_seq_len on purpose.
  """
  m, d, e = config.model, config.data, config.eval
  if e.enabled and (e.prompt_sets or e.jsonl or d.source == 'synthetic'):
    longest = min(e.max_prompt_tokens, d.seq_len) if d.source == 'synthetic' else e.max_prompt_tokens
    if longest + e.max_new_tokens > m.max_seq_len:
      raise ValueError(f'eval.max_prompt_tokens={e.max_prompt_tokens} + eval.max_new_tokens={e.max_new_tokens} '
                       f'exceeds model.max_seq_len={m.max_seq_len}: a prompt and its generation must fit')
    schedule = tuple(config.looped.schedule)
    heads = schedule[-1] if schedule else config.model.num_mtp_heads
    depth = e.draft_depth or heads
    if depth and heads:  # the decoding state (a tree keeps one row per path) must fit before anything trains
      _check_cross_fields(config)  # a model that cannot be built is named by its own rule first
      cfg = dataclasses.replace(recipe.model_config(config), num_mtp_heads=heads)
      opts = decode.options(e.max_new_tokens, draft_depth=depth, tree=tuple(e.tree))
      need, have = decode.state_bytes(cfg, e.batch_size, -(-longest // 64) * 64, opts), memory_bytes()
      if need > have:
        raise ValueError(f'decoding at eval.draft_depth={depth}' + (f', eval.tree={tuple(e.tree)} '
                         f'({opts.draft.paths} paths)' if e.tree else '') + f' holds a {need / 2**30:.1f} GiB state '
                         f'at eval.batch_size={e.batch_size}, more than the {have / 2**30:.1f} GiB this device has: '
                         'use a smaller tree, depth or batch')


def memory_bytes() -> int:
  """The memory decoding runs in: the first device's, or on a CPU this machine's."""
  import jax  # pylint: disable=import-outside-toplevel
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get('bytes_limit') or os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def _check_mesh(config: ml_collections.ConfigDict) -> None:
  mesh_shape = sharding.resolve_mesh_shape(config.mesh.shape, config.mesh.axes,
                                           sharding.mesh_device_count(config.mesh.shape))
  data_parallel = math.prod(n for n, ax in zip(mesh_shape, config.mesh.axes) if ax in sharding.AXIS_RULES['batch'])
  if config.data.batch_size % data_parallel:
    raise ValueError(f'data.batch_size={config.data.batch_size} is not divisible by the {data_parallel}-way '
                     'data-parallel mesh axes')
  recipe.model_config(config)  # ModelConfig and MoEConfig check their own shape constraints


def _check_files(config: ml_collections.ConfigDict) -> None:
  """Token, prompt and GGUF files are read through once now, so a bad one stops the run before any work."""
  d, e, m = config.data, config.eval, config.model
  if d.source == 'tokens':  # 'embedded' writes its own token file, checked as it builds it
    records = max(len(data.load_token_file(d.train_path, m.vocab_size)) - 1, 0) // d.seq_len
    train = int(records * (1.0 - d.eval_fraction))
    for part, n in (('training', train), ('held-out', records - train)):
      if n < d.batch_size:
        raise ValueError(f'token file {d.train_path}: its {part} part (data.eval_fraction={d.eval_fraction}) has '
                         f'{n} windows of data.seq_len+1={d.seq_len + 1} tokens, fewer than '
                         f'data.batch_size={d.batch_size}')
  if d.source == 'text':  # its contents are read (and any bad line named) as it is tokenized
    text_corpus.check_file(d.train_path)
  if d.source == 'synthetic' and d.synthetic_records < d.batch_size:
    raise ValueError(f'data.synthetic_records={d.synthetic_records} is fewer than data.batch_size={d.batch_size}')
  _validate_pretrained(config)
  for entry in e.jsonl:
    name, _, spec = entry.partition('=')
    path, _, field = spec.partition(':')
    if not os.path.isfile(path):
      raise FileNotFoundError(f"eval.jsonl entry {entry!r}: prompt file {path} does not exist "
                              "(expected 'name=path[:field]')")
    if e.enabled:
      prompts.check_jsonl_prompts(path, field=field or 'prompt', vocab_size=m.vocab_size,
                                  text_ok=d.source in ('embedded', 'text'), max_ids=m.max_seq_len)


def _validate_pretrained(config: ml_collections.ConfigDict) -> None:
  """A pretrained `train.init_from` must be a readable checkpoint of this model's shape; likewise the tokenizer."""
  init_from, tok = config.train.init_from, config.data.tokenizer
  if export.is_export(init_from):  # exported heads: their base model must fit too
    init_from = export.base_of(init_from)
  if pretrained.is_pretrained(init_from):
    pretrained.check_model_config(config.model.to_dict(), init_from)
  elif init_from and config.train.init_heads == 'trunk':
    raise ValueError(f"train.init_heads='trunk' needs a pretrained train.init_from ({pretrained.KINDS}), "
                     f'not {init_from!r}')
  elif init_from and not os.path.isdir(init_from):
    raise FileNotFoundError(f'train.init_from={init_from!r} is neither a workdir nor {pretrained.KINDS}')
  if tok != 'bpe':
    if not pretrained.is_pretrained(tok):
      raise ValueError(f"data.tokenizer={tok!r} is not 'bpe' nor {pretrained.KINDS}")
    if pretrained.load_tokenizer(tok).vocab_size > config.model.vocab_size:
      raise ValueError(f'data.tokenizer={tok!r} has {pretrained.load_tokenizer(tok).vocab_size} tokens, '
                       f'more than model.vocab_size={config.model.vocab_size}')
