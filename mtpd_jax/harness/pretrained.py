"""A pretrained checkpoint, whichever its format: a llama GGUF file (gguf_llama.py: 'smollm2' or a
.gguf path) or a Hugging Face folder (hf_llama.py: 'hf:<dir>'). `train.init_from` and
`data.tokenizer` name one; this file answers the same questions of both.
"""

import os

import jax
import numpy as np
from flax import nnx

from mtpd_jax.harness import gguf_llama, hf_llama

KINDS = "'smollm2', a .gguf path or 'hf:<Hugging Face folder>'"


def is_pretrained(ref) -> bool:
  return gguf_llama.is_gguf(ref) or hf_llama.is_hf(ref)


def _module(ref: str):
  return hf_llama if hf_llama.is_hf(ref) else gguf_llama


def model_fields(ref: str) -> dict:
  return _module(ref).model_fields(ref)


def check_model_config(model: dict, ref: str) -> None:
  _module(ref).check_model_config(model, ref)


def load_tokenizer(ref: str):
  return _module(ref).load_tokenizer(ref)


def fingerprint(ref: str) -> str:
  return _module(ref).fingerprint(ref)


def load_model(ref: str, **kwargs):
  return _module(ref).load_model(ref, **kwargs)


def identity(ref: str) -> dict:
  """What names the checkpoint's weights for a cache key: its file(s), by path, size and time."""
  path = hf_llama.resolve(ref) if hf_llama.is_hf(ref) else gguf_llama.resolve(ref)
  files = [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith('.safetensors')] if os.path.isdir(
      path) else [path]
  return {os.path.realpath(f): [os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files}


def derive_model(config, explicit: set[str]) -> None:
  """Set `config.model`'s shape from a pretrained `train.init_from` (or the base of exported heads),
  so a user does not type it; a field the command line set (`explicit`: 'model.x' names) and the
  checkpoint contradicts is refused in one line instead. A pretrained `data.tokenizer` that the
  command line did not set becomes the checkpoint's own."""
  from mtpd_jax.harness import export  # pylint: disable=import-outside-toplevel
  ref = config.train.init_from
  ref = export.base_of(ref) if export.is_export(ref) else ref
  if not is_pretrained(ref):
    return
  bad = []
  for name, value in model_fields(ref).items():
    current = tuple(config.model[name]) if name == 'rope_scaling' else config.model[name]
    same = np.isclose(current, value) if isinstance(value, float) else current == value
    if f'model.{name}' in explicit and not same:
      bad.append(f'model.{name}={current!r} (the checkpoint has {value!r})')
    config.model[name] = value
  if bad:
    raise ValueError(f'train.init_from={ref} contradicts the command line: ' + '; '.join(bad))
  # A recipe's pretrained tokenizer (smollm2_mtpd's 'smollm2') is its model's: another model
  # brings its own, unless the command line names one.
  if 'data.tokenizer' not in explicit and is_pretrained(config.data.tokenizer):
    config.data.tokenizer = ref


def init_params(graphdef: nnx.GraphDef, params: nnx.State, ref: str, *, trunk_heads: bool) -> nnx.State:
  """Trunk parameters from the checkpoint; with `trunk_heads`, MTP heads that start near the trunk.

  A 'trunk' head k is the trunk's last block applied once more: its block is a copy of the last
  trunk block, its projection M_k = [c·I; 0] passes the normalised hidden state h^{k-1} through at
  the trunk's own hidden scale c (the median RMS of h^0 over CALIBRATION_TEXT) and reads nothing
  of the token embedding yet, and its two RMSNorm scales are 1. So the block sees inputs of the
  scale it was trained on, and training first has to learn only what the next token adds.
  Otherwise heads keep `params`' fresh initialisation.
  """
  if hf_llama.is_hf(ref):
    params = hf_llama.init_params(params, ref)
  else:
    params = gguf_llama.apply_params(params, gguf_llama.load_params(ref))
  if not trunk_heads or 'mtp_heads' not in params or not len(params['mtp_heads']):
    return params
  model = nnx.merge(graphdef, params)
  tokens_1xT = jax.numpy.asarray([load_tokenizer(ref).encode(CALIBRATION_TEXT)], jax.numpy.int32)
  h_TxD = np.asarray(model(tokens_1xT).hidden_K1xBxTxD[0, 0], np.float32)
  scale = float(np.median(np.sqrt(np.mean(h_TxD[1:] ** 2, axis=-1))))  # position 0 is an attention sink
  key = gguf_llama.param_key
  leaves = {key(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  last = len(params['blocks']) - 1

  def one(path, leaf):
    k = key(path)
    if k[0] != 'mtp_heads':
      return leaf
    if k[2] == 'block':
      return leaves[('blocks', last) + k[3:]]
    if k[2] == 'proj':  # (2D, D): rows [0, D) read h^{k-1}, rows [D, 2D) the embedding
      d = leaf.shape[1]
      return np.concatenate([scale * np.eye(d), np.zeros((d, d))]).astype(np.float32)
    return np.ones(leaf.shape, np.float32)  # hidden_norm, embed_norm scales
  return jax.tree_util.tree_map_with_path(one, params)


# A short everyday text: the trunk's hidden-state scale on it calibrates the heads' 'trunk' init.
CALIBRATION_TEXT = ('The capital of France is Paris. Water boils at 100 degrees Celsius at sea level. '
                    'To sort a list in Python, call sorted(items) or items.sort(). Thank you for your help!')
