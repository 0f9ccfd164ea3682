"""Config -> the core's frozen settings: model shape, β_k, the loss and step settings, the optimizer,
data sources and iterators, prompt sets. Reading a ConfigDict stops here: the core takes what
these functions return (docs/design.md, "Two layers").
"""

import copy
import hashlib

import jax
import ml_collections
import numpy as np
import optax

from mtpd_jax import data, decode, losses, train
from mtpd_jax.harness import corpus, evaluate, prompts, regenerate, teacher_cache, text_corpus, trunk_cache
from mtpd_jax.model import ModelConfig
from mtpd_jax.moe import MoEConfig

BETA_SCHEDULES = ('constant', 'exp_decay', 'linear_decay', 'linear_increase')


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  fields = config.model.to_dict()
  moe = fields.pop('moe', {})  # workdirs saved before MoE existed have no model.moe
  return ModelConfig(**fields, moe=MoEConfig(**moe))


def resolve_beta(config: ml_collections.ConfigDict) -> tuple[float, ...]:
  """β_k per head: explicit per-head values, or a base β shaped by `beta_schedule` over depth k."""
  d, num_mtp_heads = config.distill, config.model.num_mtp_heads
  if isinstance(d.beta, (list, tuple)):
    if len(d.beta) != num_mtp_heads:
      raise ValueError(f'distill.beta has {len(d.beta)} values for model.num_mtp_heads={num_mtp_heads}')
    return tuple(float(b) for b in d.beta)
  # Table 2's caption (K=1); design.md, "Choices"
  base = (1.0 if num_mtp_heads == 1 else 0.5) if d.beta is None else float(d.beta)
  weights = {'constant': lambda k: 1.0,
             'exp_decay': lambda k: d.step_gamma ** (k - 1),
             'linear_decay': lambda k: (num_mtp_heads - k + 1) / num_mtp_heads,
             'linear_increase': lambda k: k / num_mtp_heads}
  if d.beta_schedule not in weights:
    raise ValueError(f'unknown distill.beta_schedule {d.beta_schedule!r}; expected one of {BETA_SCHEDULES}')
  return tuple(base * weights[d.beta_schedule](k) for k in range(1, num_mtp_heads + 1))


def loss_config(config: ml_collections.ConfigDict) -> losses.LossConfig:
  d = config.distill
  return losses.LossConfig(ce_weight=config.mtp.ce_weight, beta=resolve_beta(config), distill=d.enabled,
                           top_n=d.top_n, top_n_mode=d.top_n_mode, renormalize=d.renormalize, kl=d.kl,
                           tau=d.tau, detach=d.detach, teacher=d.teacher, selection=d.selection,
                           divergence=d.divergence)


def step_config(config: ml_collections.ConfigDict, head_vocab_ids=None) -> train.StepConfig:
  """The step settings; `head_vocab_ids` (`head_vocab_ids(config)`) when mtp.head_vocab > 0."""
  if config.mtp.head_vocab and head_vocab_ids is None:
    head_vocab_ids = range(config.mtp.head_vocab)  # a stand-in of the right size, for checking settings
  return train.StepConfig(loss=loss_config(config), isolate_trunk=config.mtp.isolate_trunk,
                          kl_warmup_steps=config.distill.warmup_steps,
                          loss_chunk_rows=config.train.loss_chunk_rows,
                          skip_nonfinite=config.train.on_nan == 'skip',
                          head_vocab=tuple(int(i) for i in head_vocab_ids) if config.mtp.head_vocab else ())


def frequent_training_tokens(config: ml_collections.ConfigDict, size: int) -> np.ndarray:
  """The `size` most frequent ids of the training records, ascending (`evaluate.frequent_tokens`):
  counted over the whole training split of a token file, or over the first 4,096 synthetic records."""
  source = make_source(config, 'train')
  if isinstance(source, data.PackedTokens):
    tokens = source.tokens[source.start * source.seq_len:source.stop * source.seq_len + 1]
  else:
    tokens = np.concatenate([source[i]['inputs'] for i in range(min(len(source), 4096))])
  return evaluate.frequent_tokens(tokens, size)


def head_vocab_ids(config: ml_collections.ConfigDict) -> np.ndarray | None:
  """mtp.head_vocab's ids: the U most frequent training tokens (None when it is 0)."""
  return frequent_training_tokens(config, config.mtp.head_vocab) if config.mtp.head_vocab else None


def head_vocab_meta(ids) -> dict:
  """What a checkpoint keeps of a head vocabulary (`train.TrainSpec.checkpoint_meta`)."""
  ids = [int(i) for i in ids]
  digest = hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest()
  return {'head_vocab': {'ids': ids, 'sha256': digest, 'describe': f'{len(ids)} ids, sha256 {digest[:12]}'}}


def loop_config(config: ml_collections.ConfigDict) -> train.LoopConfig:
  t = config.train
  return train.LoopConfig(steps=t.steps, log_every=t.log_every, eval_every=t.eval_every,
                          eval_batches=t.eval_batches, ckpt_every=config.ckpt.every_steps,
                          max_to_keep=config.ckpt.max_to_keep,
                          tokens_per_step=config.data.batch_size * config.data.seq_len,
                          raise_on_nan=t.on_nan != 'skip')


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
  d = config.data
  return corpus.prepare_embedded(d.cache_dir or None, vocab_size=config.model.vocab_size,
                                 max_chars=d.embedded_chars, code_fraction=d.code_fraction,
                                 tokenizer=d.tokenizer)


def text_data(config: ml_collections.ConfigDict) -> text_corpus.TextData:
  """`data.source='text'`: the user's file, tokenized once (text_corpus.py)."""
  d = config.data
  return text_corpus.prepare_text(d.train_path, field=d.text_field, tokenizer=d.tokenizer,
                                  vocab_size=config.model.vocab_size, cache_dir=d.cache_dir or corpus.default_cache_dir())


def tokenizer(config: ml_collections.ConfigDict):
  """The tokenizer of a text source ('embedded' or 'text'), or None for token ids."""
  if config.data.source == 'embedded':
    return embedded_data(config).tokenizer()
  return text_data(config).tokenizer() if config.data.source == 'text' else None


def make_source(config: ml_collections.ConfigDict, split: str):
  """The train or held-out record source named by `config.data`."""
  d = config.data
  if d.source == 'synthetic':  # held-out records come from another seed of the same process
    return data.SyntheticSource(config.model.vocab_size, d.seq_len, d.synthetic_records,
                                seed=d.seed + (0 if split == 'train' else 1_000_003))
  if d.source not in ('tokens', 'embedded', 'text'):
    raise ValueError(f"unknown data.source {d.source!r}; expected 'synthetic', 'tokens', 'embedded' or 'text'")
  path, eos_id = (d.train_path, d.eos_id) if d.source == 'tokens' else (
      lambda e: (e.train_tokens_path, e.eos_id))(embedded_data(config) if d.source == 'embedded' else text_data(config))
  if d.source == 'embedded' and d.regenerate and split == 'train':  # the model's own answers, all of them
    return data.PackedTokens(regenerate.tokens_path(config), d.seq_len, eos_id, config.model.vocab_size)
  cut = 1.0 - d.eval_fraction
  return data.PackedTokens(path, d.seq_len, eos_id, config.model.vocab_size,
                           split=(0.0, cut) if split == 'train' else (cut, 1.0))


def make_trunk_cache(config: ml_collections.ConfigDict, ids=None) -> trunk_cache.TrunkCache | None:
  """The run's trunk-state cache (`train.trunk_cache`), unbuilt, or None; with `train.teacher_cache`
  it builds and serves the main head's teacher over the head vocabulary's `ids` too (default:
  `head_vocab_ids(config)`)."""
  if not config.train.trunk_cache:
    return None
  cache = trunk_cache.TrunkCache(config, config.data.cache_dir or corpus.default_cache_dir())
  if config.train.teacher_cache:
    ids = head_vocab_ids(config) if ids is None else ids
    cache.teacher = teacher_cache.TeacherCache(cache, ids, top_n=config.distill.top_n, tau=config.distill.tau)
  return cache


def make_data_iterator(config: ml_collections.ConfigDict, split: str,
                       cache: trunk_cache.TrunkCache | None = None):
  """Batches of `split`; with `cache` each record also carries its cached `trunk_hidden`."""
  d = config.data
  source = make_source(config, split)
  source = cache.wrap(source, split) if cache else source
  return data.make_iterator(source, global_batch=d.batch_size, seed=d.seed,
                            shuffle=d.shuffle and split == 'train', process_index=jax.process_index(),
                            process_count=jax.process_count())


def stop_tokens(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  """Where generation stops: a text source's tokenizer's stop tokens (EOS, and for an instruct model
  its end of turn), else data.eos_id."""
  tok = tokenizer(config)
  return (config.data.eos_id,) if tok is None else tuple(tok.stop_ids)


def decode_options(config: ml_collections.ConfigDict, draft_depth: int, head_vocab=None) -> decode.DecodeOptions:
  """How `eval.*` decodes, speculatively at `draft_depth`: the one place a config becomes decoding
  options. Heads trained over a head vocabulary (`head_vocab`, its ids as saved with them) draft
  among those ids; otherwise `eval.draft_vocab` > 0 picks that many of the most frequent training
  tokens."""
  e = config.eval
  vocab = head_vocab
  if vocab is None and e.get('draft_vocab', 0):
    vocab = frequent_training_tokens(config, e.draft_vocab)
  return decode.options(e.max_new_tokens, draft_depth=draft_depth, tree=tuple(e.get('tree', ())),
                        draft_min_prob=e.get('draft_min_prob', 0.0), draft_vocab=vocab,
                        draft_source=e.get('draft_source', 'heads'), ngram=e.get('ngram', 3),
                        stop_tokens=stop_tokens(config))


def use_chat_template(config: ml_collections.ConfigDict, tokenizer) -> bool:
  """Whether text prompts of eval.jsonl files become chat user turns (`eval.chat_template`).

  'auto': when the tokenizer carries a model's own chat template (an instruct GGUF model, which is
  prompted that way); the BPE trained on the embedded text is a base model's and gets none.
  """
  mode = config.eval.chat_template
  return mode == 'on' or (mode == 'auto' and tokenizer is not None and tokenizer.chat_template is not None)


def prompt_sets(config: ml_collections.ConfigDict) -> dict[str, list[np.ndarray]]:
  """Named prompt sets (token-id arrays) for the decoding evaluation.

  `embedded` and `text`: the held-out `chat` (ShareGPT first turns, chat template), `code`
  (HumanEval) and `math` (CHAMP) sets named in `eval.prompt_sets`, in the source's tokenizer.
  `synthetic`: starts of held-out records. Extra sets come from `eval.jsonl` entries 'name=path'
  or 'name=path:field' (text needs a text source's tokenizer; a field of token ids works with any).
  """
  e, source = config.eval, config.data.source
  tok = tokenizer(config)
  sets = {}
  if source == 'synthetic':
    src = make_source(config, 'eval')
    sets['synthetic'] = [src[i]['inputs'][:e.max_prompt_tokens] for i in range(min(e.max_prompts, len(src)))]
  elif tok is not None:
    for name in e.prompt_sets:
      sets[name] = prompts.load_prompt_set(name, tokenizer=tok, max_prompts=e.max_prompts,
                                           max_prompt_tokens=e.max_prompt_tokens, chat_template=name == 'chat')
  for entry in e.jsonl:
    name, _, spec = entry.partition('=')
    path, _, field = spec.partition(':')
    sets[name] = prompts.load_jsonl_prompts(path, tokenizer=tok, field=field or 'prompt', max_prompts=e.max_prompts,
                                            max_prompt_tokens=e.max_prompt_tokens,
                                            chat_template=use_chat_template(config, tok))
  if not sets:
    raise ValueError(f'no prompt sets for data.source={source!r}; name JSONL files in eval.jsonl')
  return sets


def calibration_prompts(config: ml_collections.ConfigDict) -> list[np.ndarray]:
  """The speculation planner's prompts: `eval.calibration_prompts` per set, the ones that follow the
  `eval.max_prompts` that `prompt_sets` measures, so no measured prompt also chose the setting."""
  e = config.eval
  more = copy.deepcopy(config)
  more.eval.max_prompts = e.max_prompts + e.calibration_prompts
  out = [p for prompts in prompt_sets(more).values() for p in prompts[e.max_prompts:]]
  if not out:
    raise ValueError(f"eval.speculation='auto' calibrates on prompts past eval.max_prompts={e.max_prompts}, "
                     'and no prompt set has more: lower eval.max_prompts')
  return out
