"""Training text the model wrote itself: its own answers to the training conversations' user turns.

Greedy acceptance is agreement with the model's own greedy continuation, so heads trained on that
continuation learn exactly what decoding asks of them; EAGLE, Medusa-2 and SpecForge train on
regenerated text for this reason (docs/design.md, "Regenerated text"). `build` decodes, with this
project's engine, the answer of `train.init_from`'s main head to each user turn of the embedded
corpus's training conversations, as a single-turn chat prompt cut to
`data.regenerate_prompt_tokens` from the left, greedily or sampled at
`data.regenerate_temperature`, up to `data.regenerate_new_tokens` (the first
`data.regenerate_prompts` turns, or all). Decoding is plain, since the
heads do not exist yet. The stream `prompt answer EOS ...` then replaces the corpus's training
text (recipe.make_source); held-out text and the prompt sets stay the corpus's.

The cache entry `<cache dir>/regen-<key>/` is keyed by the answering model (its file or
checkpoint), the corpus and these settings. It fills one part file per batch of prompts
(`part-NNNNN.npy`, each written atomically), so a killed build resumes at the first missing part,
and `train_tokens.npy`, renamed into place only when every part is there, is what marks it done.
"""

import hashlib
import json
import os
from collections.abc import Callable

import ml_collections
import numpy as np

from mtpd_jax import decode, runtime, train
from mtpd_jax.harness import corpus, pretrained, prompts
from mtpd_jax.model import MTPTransformer

FORMAT = 'regenerated/v1'


def _model_identity(init_from: str) -> dict:
  """What names the answering model's weights: its checkpoint file(s), or its workdir's latest
  checkpoint."""
  if pretrained.is_pretrained(init_from):
    return pretrained.identity(init_from)
  ckpts = os.path.join(init_from, train.CHECKPOINTS)
  steps = sorted(int(n) for n in os.listdir(ckpts) if n.isdigit()) if os.path.isdir(ckpts) else []
  if not steps:
    raise FileNotFoundError(f'train.init_from={init_from}: no checkpoint to regenerate the '
                            'training text with')
  path = os.path.join(ckpts, str(steps[-1]))
  st = os.stat(path)
  return dict(path=os.path.realpath(path), size=st.st_size, mtime_ns=st.st_mtime_ns)


def _embedded(config: ml_collections.ConfigDict) -> corpus.EmbeddedData:
  """The embedded corpus whose training conversations' user turns are answered."""
  d = config.data
  return corpus.prepare_embedded(d.cache_dir or None, vocab_size=config.model.vocab_size,
                                 max_chars=d.embedded_chars, code_fraction=d.code_fraction,
                                 tokenizer=d.tokenizer)


def inputs(config: ml_collections.ConfigDict) -> dict:
  d = config.data
  model = _model_identity(config.train.init_from)
  return dict(format=FORMAT, model=model, corpus=_embedded(config).key,
              temperature=d.regenerate_temperature, new_tokens=d.regenerate_new_tokens,
              prompt_tokens=d.regenerate_prompt_tokens, batch_size=d.regenerate_batch_size,
              prompts=d.regenerate_prompts, seed=d.seed)


def directory(config: ml_collections.ConfigDict) -> str:
  key = hashlib.sha256(json.dumps(inputs(config), sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(config.data.cache_dir or corpus.default_cache_dir(), f'regen-{key}')


def tokens_path(config: ml_collections.ConfigDict) -> str:
  """The regenerated training stream; refuses when `build` has not completed it."""
  path = os.path.join(directory(config), 'train_tokens.npy')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'the regenerated training text {path} is not built yet '
                            '(data.regenerate: the training run builds it before its first step)')
  return path


def _part(path: str) -> np.ndarray:
  try:
    return np.load(path, allow_pickle=False)
  except (ValueError, OSError) as e:
    raise ValueError(f'regenerated text file {path} is damaged ({e}); delete it and rerun to '
                     'decode its answers again') from None


def build(config: ml_collections.ConfigDict, load_model: Callable[[], MTPTransformer], *,
          progress: bool = True) -> str:
  """Decode (or finish decoding) the regenerated training text with the model `load_model()`
  returns (train.init_from's); returns its token file's path."""
  out_dir = directory(config)
  final = os.path.join(out_dir, 'train_tokens.npy')
  if os.path.isfile(final):
    return final
  import jax  # pylint: disable=import-outside-toplevel
  if jax.process_index() == 0:
    parts, vocab_size = _decode_parts(config, out_dir, load_model, progress)
    stream = np.concatenate([_part(path) for path in parts])
    tmp = os.path.join(out_dir, f'.tmp-train_tokens-{os.getpid()}.npy')
    np.save(tmp, stream.astype(np.uint16 if vocab_size <= 1 << 16 else np.int32))
    os.replace(tmp, final)
  runtime.sync_processes('regenerate')
  return final


def _document(prompt, answer, eos_id: int) -> np.ndarray:
  """One training document: the prompt, the answer, and EOS (once, where the answer ends with
  it)."""
  end = [] if len(answer) and answer[-1] == eos_id else [eos_id]
  return np.concatenate([prompt, answer, end]).astype(np.int32)


def _decode_parts(config, out_dir: str, load_model, progress: bool) -> tuple[list[str], int]:
  """Decode every batch whose part file is missing; returns the part files in order and the
  vocabulary size."""
  d = config.data
  embedded = _embedded(config)
  tok = embedded.tokenizer()
  texts = corpus.training_user_turns(d.embedded_chars, d.code_fraction)
  texts = texts[:d.regenerate_prompts or len(texts)]
  prompt_ids = prompts.encode_prompts(texts, tokenizer=tok, chat_template=True,
                                      max_prompt_tokens=d.regenerate_prompt_tokens)
  # Similar lengths share a batch's padding.
  order = np.argsort([len(p) for p in prompt_ids], kind='stable')
  size = d.regenerate_batch_size
  batches = [order[i:i + size] for i in range(0, len(order), size)]
  os.makedirs(out_dir, exist_ok=True)
  meta = dict(inputs=inputs(config), prompts=len(prompt_ids), batches=len(batches))
  meta_json = json.dumps(meta, indent=1, sort_keys=True)
  runtime.write_atomically(os.path.join(out_dir, 'meta.json'), meta_json)
  names = [os.path.join(out_dir, f'part-{i:05d}.npy') for i in range(len(batches))]
  todo = [i for i, name in enumerate(names) if not os.path.isfile(name)]
  if not todo:
    return names, tok.vocab_size
  structure, leaves = decode.split(load_model())
  opts = decode.options(d.regenerate_new_tokens, temperature=d.regenerate_temperature,
                        stop_tokens=tok.stop_ids)
  bar = runtime.progress_bar(progress, len(batches) - len(todo), len(batches),
                             desc='regenerating answers')
  with bar:
    for i in todo:
      batch = [prompt_ids[j] for j in batches[i]]
      full = batch + [batch[-1]] * (size - len(batch))  # one shape for the last batch too
      out = decode.generate_split(structure, leaves, full, opts, seed=d.seed + i, pad_multiple=64)
      answers = out.tokens[:len(batch)]
      stream = np.concatenate([_document(p, a, embedded.eos_id) for p, a in zip(batch, answers)])
      tmp = names[i] + f'.tmp-{os.getpid()}.npy'
      np.save(tmp, stream.astype(np.int32))
      os.replace(tmp, names[i])
      bar.update(1)
  return names, tok.vocab_size
