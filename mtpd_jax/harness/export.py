"""Trained MTP heads out of a workdir as safetensors, and back in: share heads without orbax.

`export_heads` writes, into a folder:
- `mtp_heads.safetensors`: each head k as DeepSeek-V3's MTP layer `model.layers.{L+k-1}.` after
  the L trunk layers: `enorm` (the token embedding's RMSNorm), `hnorm` (the previous hidden state's),
  `eh_proj` (the (D, 2D) projection of [enorm(embedding); hnorm(h)], DeepSeek-V3's order) and the
  block in the checkpoint's own Llama naming (`input_layernorm`, `self_attn.{q,k,v,o}_proj`,
  `post_attention_layernorm`, `mlp.{gate,up,down}_proj`, `self_attn.{q,k}_norm`, biases), in
  PyTorch's (out, in) layout. The shared head (final norm and unembedding) is the base model's and
  is not copied (docs/design.md, "Exported heads", says which serving engines read what).
- `mtp_config.json`: K, the layout, the head vocabulary's ids (or null), and the base model: what
  `train.init_from` named, its model fields and a sha256 of its trunk parameters.

`train.init_from=<that folder>` starts a run from the base model named there with these heads,
after checking the base's hash and, for heads over a head vocabulary, that this run's ids are the
exported ones: a changed base model or head vocabulary is refused in one line.
"""

import json
import os

import jax
import numpy as np
from flax import nnx

from mtpd_jax import runtime
from mtpd_jax.harness import gguf_llama, hf_llama, trunk_cache

FORMAT = 'mtpd_jax-mtp-heads/v1'
CONFIG = 'mtp_config.json'
WEIGHTS = 'mtp_heads.safetensors'


def is_export(ref) -> bool:
  return isinstance(ref, str) and os.path.isfile(os.path.join(ref, CONFIG))


def _tensor_name(key: tuple, num_layers: int) -> str:
  """The file's name of one head parameter (('mtp_heads', k-1, ...)): DeepSeek-V3's MTP layer L+k-1."""
  _, k, *rest = key
  prefix = f'model.layers.{num_layers + k}.'
  own = {('embed_norm', 'scale'): 'enorm.weight', ('hidden_norm', 'scale'): 'hnorm.weight', ('proj',): 'eh_proj.weight'}
  if tuple(rest) in own:
    return prefix + own[tuple(rest)]
  return hf_llama.tensor_name(('blocks', num_layers + k, *rest[1:]))


def _to_disk(key: tuple, x: np.ndarray, dim: int) -> np.ndarray:
  """Our layout -> the file's: matrices (in..., out...) -> (out, in); eh_proj's input halves swapped
  into DeepSeek-V3's [embedding; hidden] order; vectors flattened."""
  if key[-1] == 'proj':  # ours reads [hidden; embedding]
    return np.ascontiguousarray(np.concatenate([x[dim:], x[:dim]]).T)
  if key[-1] in ('wq', 'wk', 'wv', 'w_gate', 'w_up'):
    return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
  if key[-1] in ('wo', 'w_down'):
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)
  return np.ascontiguousarray(x.reshape(-1))


def _from_disk(key: tuple, x: np.ndarray, shape: tuple, dim: int) -> np.ndarray:
  if key[-1] == 'proj':
    x = x.T
    return np.concatenate([x[dim:], x[:dim]]).reshape(shape)
  if key[-1] in ('wq', 'wk', 'wv', 'w_gate', 'w_up', 'wo', 'w_down'):
    return np.ascontiguousarray(x.T).reshape(shape)
  return x.reshape(shape)


def export_heads(model, config, head_vocab, out_dir: str) -> dict:
  """Write a trained model's heads (its config: the workdir's; `head_vocab`: the ids saved with its
  checkpoint, or None) and mtp_config.json into `out_dir`; returns the config written."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  if not config.model.num_mtp_heads:
    raise ValueError('the model has no MTP heads; nothing to export')
  params = nnx.state(model, nnx.Param)
  cfg = model.cfg
  tensors = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    key = gguf_llama.param_key(path)
    if key[0] == 'mtp_heads':
      tensors[_tensor_name(key, cfg.num_layers)] = _to_disk(key, np.asarray(leaf, np.float32), cfg.dim)
  ids = head_vocab
  meta = {'format': FORMAT, 'num_mtp_heads': cfg.num_mtp_heads, 'layout': 'deepseek_v3',
          'first_layer': cfg.num_layers, 'eh_proj_input': ['enorm(embedding of token i+k)', 'hnorm(h^{k-1}_i)'],
          'shared_head': 'the base model\'s final norm and lm_head (not stored)',
          'head_vocab': None if ids is None else [int(i) for i in ids],
          'base': {'init_from': config.train.init_from, 'model': config.model.to_dict(),
                   'trunk_sha256': trunk_cache.trunk_digest(params)}}
  os.makedirs(out_dir, exist_ok=True)
  tmp = os.path.join(out_dir, f'.tmp-{os.getpid()}.safetensors')
  save_file(tensors, tmp)
  runtime.chmod_as_created(tmp)  # safetensors writes a private file; the heads are for sharing
  os.replace(tmp, os.path.join(out_dir, WEIGHTS))
  runtime.write_atomically(os.path.join(out_dir, CONFIG), json.dumps(meta, indent=1))
  return meta


def read_config(ref: str) -> dict:
  path = os.path.join(ref, CONFIG)
  try:
    with open(path, encoding='utf-8') as f:
      meta = json.load(f)
  except ValueError as e:
    raise ValueError(f'{path} is not valid JSON ({e})') from None
  if meta.get('format') != FORMAT:
    raise ValueError(f'{path} is not an export of MTP heads ({FORMAT})')
  return meta


def load_heads(params: nnx.State, ref: str, model_cfg, head_vocab=None) -> nnx.State:
  """`params` (whose trunk is the base model's) with the exported heads; the base's hash and the
  head vocabulary are checked first."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  meta = read_config(ref)
  digest = trunk_cache.trunk_digest(params)
  if digest != meta['base']['trunk_sha256']:
    raise ValueError(f'{ref}: these heads were trained on another base model (trunk sha256 '
                     f"{meta['base']['trunk_sha256'][:12]}, this one {digest[:12]}); load them onto their own base")
  saved = meta.get('head_vocab')
  mine = None if head_vocab is None else [int(i) for i in head_vocab]
  if saved != mine:
    raise ValueError(f'{ref}: its heads draft among {"all ids" if saved is None else f"{len(saved)} head-vocabulary ids"}'
                     f', this run among {"all ids" if mine is None else f"{len(mine)} other ones" if saved else "a head vocabulary"}: '
                     'they must be the same ids (mtp.head_vocab and the data it is counted on)')
  with safe_open(os.path.join(ref, WEIGHTS), framework='numpy') as f:
    names = set(f.keys())

    def one(path, leaf):
      key = gguf_llama.param_key(path)
      if key[0] != 'mtp_heads':
        return leaf
      name = _tensor_name(key, model_cfg.num_layers)
      if name not in names:
        raise ValueError(f'{ref}: tensor {name} is missing (this model has {model_cfg.num_mtp_heads} heads, '
                         f"the export {meta['num_mtp_heads']})")
      value = _from_disk(key, f.get_tensor(name), leaf.shape, model_cfg.dim)
      sharding = getattr(leaf, 'sharding', None)
      return jax.device_put(value, sharding) if sharding is not None else value
    return jax.tree_util.tree_map_with_path(one, params)


def base_of(ref: str) -> str:
  """The base model an export's heads were trained on (its train.init_from)."""
  return read_config(ref)['base']['init_from']
