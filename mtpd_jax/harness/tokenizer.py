"""A byte-level BPE tokenizer trained offline with `tokenizers`, cached by a hash of its inputs.

Text always encodes to ordinary tokens (a literal '<|endoftext|>' in a document is text, not EOS);
the special tokens enter a sequence only as explicit ids: EOS after each document and the
ChatML-like turn markers `<|im_start|>role\\n ... <|im_end|>` built by `chat_turn`/`chat_prompt`.
A pretrained model's tokenizer (pretrained.py) brings its own Jinja chat template instead, which
`chat` renders around the already-encoded turns.
"""

import hashlib
import os
import re
from collections.abc import Iterable, Sequence

from mtpd_jax import runtime

EOS, IM_START, IM_END = '<|endoftext|>', '<|im_start|>', '<|im_end|>'
SPECIAL_TOKENS = (EOS, IM_START, IM_END)  # ids 0, 1, 2
_INSTALL = 'pip install --no-deps tokenizers==0.23.3'


def tokenizers_module():
  try:
    import tokenizers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f'the embedded tokenizer needs the `tokenizers` package: {_INSTALL}') from e
  return tokenizers


_SLOT = '\ue000{}\ue001'  # a private-use placeholder for turn i's text while the template renders
_SLOT_RE = re.compile('\ue000(\\d+)\ue001')


class Tokenizer:
  """Plain-text encode/decode with exact round trips; special tokens only as explicit ids.

  Chat formatting: the built-in `<|im_start|>role\\n ... <|im_end|>` turns, or a model's Jinja
  `chat_template` (rendered with text placeholders, so turn texts keep their own encoding).
  `eos` separates documents; `stop_tokens` end a generation.
  """

  def __init__(self, tok, *, eos: str = EOS, chat_template: str | None = None,
               stop_tokens: Sequence[str] | None = None):
    # Special-token strings inside text are encoded as bytes, so only we place EOS / turn markers.
    tok.encode_special_tokens = True
    self._tok = tok
    self.chat_template = chat_template
    self.eos_id, self.im_start_id, self.im_end_id = (tok.token_to_id(t) for t in (eos, IM_START, IM_END))
    if self.eos_id is None or (chat_template is None and None in (self.im_start_id, self.im_end_id)):
      raise ValueError(f'tokenizer lacks one of the special tokens {(eos, IM_START, IM_END)}')
    self.stop_ids = tuple(dict.fromkeys(tok.token_to_id(t) for t in (stop_tokens or (eos,))))
    self._headers: dict[str, list[int]] = {}
    self._markup: dict[str, list[int]] = {}
    self._template = None

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """`encode` of many texts at once (runs on all cores)."""
    return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def _header(self, role: str) -> list[int]:
    if role not in self._headers:
      self._headers[role] = [self.im_start_id] + self.encode(f'{role}\n')
    return self._headers[role]

  def chat_turn(self, role: str, ids: Sequence[int]) -> list[int]:
    """`<|im_start|>role\\n` + ids + `<|im_end|>`: one turn in the built-in format."""
    return self._header(role) + list(ids) + [self.im_end_id]

  def chat(self, turns: Sequence[tuple[str, Sequence[int]]], *, add_generation_prompt: bool = False) -> list[int]:
    """A conversation of (role, text ids) turns, optionally followed by the assistant header."""
    if self.chat_template is None:
      out = [i for role, ids in turns for i in self.chat_turn(role, ids)]
      return out + (self._header('assistant') if add_generation_prompt else [])
    if self._template is None:
      self._template = _jinja_template(self.chat_template)
    text = self._template.render(messages=[{'role': r, 'content': _SLOT.format(i)} for i, (r, _) in enumerate(turns)],
                                 add_generation_prompt=add_generation_prompt,
                                 bos_token='', eos_token=self._tok.id_to_token(self.stop_ids[-1]))
    out = []
    for j, piece in enumerate(_SLOT_RE.split(text)):  # markup, turn index, markup, ...
      out += list(turns[int(piece)][1]) if j % 2 else self._encode_markup(piece)
    return out

  def _encode_markup(self, text: str) -> list[int]:
    """Template text: its special-token strings become their ids, the rest encodes as text."""
    if text not in self._markup:
      specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values() if t.special),
                        key=len, reverse=True)
      parts = re.split('(' + '|'.join(map(re.escape, specials)) + ')', text) if specials else [text]
      self._markup[text] = [i for p in parts if p
                            for i in ([self._tok.token_to_id(p)] if p in specials else self.encode(p))]
    return self._markup[text]

  def chat_prompt(self, ids: Sequence[int]) -> list[int]:
    """A user turn followed by the assistant header: what a chat model continues."""
    return self.chat([('user', ids)], add_generation_prompt=True)

  @property
  def chat_overhead(self) -> int:
    """Tokens `chat_prompt` adds around the user text."""
    return len(self.chat_prompt([]))

  def to_str(self) -> str:
    """The `tokenizers` JSON."""
    return self._tok.to_str()

  def save(self, path: str) -> None:
    """Write the `tokenizers` JSON file atomically."""
    runtime.write_atomically(path, self._tok.to_str())

  @classmethod
  def load(cls, path: str) -> 'Tokenizer':
    if not os.path.isfile(path):
      raise FileNotFoundError(f'tokenizer file {path} does not exist')
    return cls(tokenizers_module().Tokenizer.from_file(path))


def _jinja_template(source: str):
  """A chat template compiled as Hugging Face does (sandboxed, trim_blocks, lstrip_blocks)."""
  try:
    from jinja2 import sandbox  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError('chat templates need jinja2: pip install --no-deps Jinja2==3.1.6 MarkupSafe==3.0.4') from e
  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

  def raise_exception(message):
    raise ValueError(f'chat template: {message}')
  env.globals['raise_exception'] = raise_exception
  return env.from_string(source)


def bpe_key(texts: Sequence[str], vocab_size: int) -> str:
  """Hash of the training texts, the settings and the `tokenizers` version."""
  h = hashlib.sha256(f'bytelevel-bpe/digits/v1/{vocab_size}/{tokenizers_module().__version__}'.encode())
  for t in texts:
    b = t.encode('utf-8', 'surrogatepass')
    h.update(len(b).to_bytes(8, 'little'))
    h.update(b)
  return h.hexdigest()[:20]


def _train(texts: Sequence[str], vocab_size: int):
  tk = tokenizers_module()
  byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok = tk.Tokenizer(tk.models.BPE())
  # Digits split one by one so numbers tokenize uniformly (as in SmolLM2 / Llama 3 tokenizers).
  tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
      [tk.pre_tokenizers.Digits(individual_digits=True), byte_level])
  tok.decoder = tk.decoders.ByteLevel()
  # All 256 byte symbols are in the vocabulary, so every text encodes and decodes exactly.
  trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                   initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                   min_frequency=2, show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
  return tok


def train_bpe(texts: Sequence[str], *, vocab_size: int = 8192,
              cache_dir: str | None = None) -> Tokenizer:
  """Train (or load from `cache_dir/bpe-<hash>.json`) a byte-level BPE on `texts`."""
  if vocab_size < 256 + len(SPECIAL_TOKENS):
    raise ValueError(f'vocab_size {vocab_size} must cover the 256 bytes and {len(SPECIAL_TOKENS)} special tokens')
  path = cache_dir and os.path.join(cache_dir, f'bpe-{bpe_key(texts, vocab_size)}.json')
  if path and os.path.isfile(path):
    return Tokenizer.load(path)
  tok = Tokenizer(_train(texts, vocab_size))
  if path:
    tok.save(path)
  return tok
