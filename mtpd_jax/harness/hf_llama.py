"""Hugging Face checkpoint folders: `config.json`, `*.safetensors` shards and tokenizer files, offline.

A reference is `hf:<dir>`, the folder a model's `save_pretrained` writes (or a hub snapshot).
Architectures: LlamaForCausalLM (with Llama 3's RoPE scaling), MistralForCausalLM,
Qwen2ForCausalLM (q/k/v biases) and Qwen3ForCausalLM (q/k RMSNorm), with grouped-query attention
and tied or untied embeddings. Anything else that would change the model (another architecture,
an activation other than SiLU, MLP or output biases, a sliding window shorter than the sequences,
another RoPE type, mixture-of-experts layers) is refused in one line that names it; nothing is
guessed. Weights are read with the `safetensors` package (no torch), one tensor at a time, and
placed straight into the shardings of the parameters they replace, so a host holds one tensor at
a time, not the model. Hugging Face's `rotate_half` RoPE is this model's `rope_interleaved=False`.
"""

import functools
import glob
import hashlib
import json
import os

import jax
import numpy as np
from flax import nnx

from mtpd_jax.harness import gguf_llama, tokenizer as tokenizer_lib
from mtpd_jax.model import ModelConfig, MTPTransformer

PREFIX = 'hf:'
ARCHITECTURES = ('LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM')


def is_hf(ref: str) -> bool:
  """True for the values of `train.init_from` / `data.tokenizer` that name a Hugging Face folder."""
  return isinstance(ref, str) and ref.startswith(PREFIX)


def resolve(ref: str) -> str:
  """The folder a reference names; it must hold a config.json."""
  path = ref[len(PREFIX):] if is_hf(ref) else ref
  if not os.path.isfile(os.path.join(path, 'config.json')):
    raise FileNotFoundError(f'{ref}: {path} is not a Hugging Face checkpoint folder (it holds no config.json)')
  return path


@functools.lru_cache(maxsize=8)
def _config(path: str) -> dict:
  try:
    with open(os.path.join(path, 'config.json'), encoding='utf-8') as f:
      return json.load(f)
  except ValueError as e:
    raise ValueError(f'{path}/config.json is not valid JSON ({e})') from None


def _rope(c: dict, where: str) -> tuple[float, tuple[float, ...]]:
  """(rope_theta, rope_scaling) from either config layout: transformers 5's `rope_parameters`, or
  `rope_theta` and `rope_scaling`."""
  params = dict(c.get('rope_parameters') or {})
  scaling = params if params else dict(c.get('rope_scaling') or {})
  theta = float(params.get('rope_theta', c.get('rope_theta', 10_000.0)))
  kind = scaling.get('rope_type', scaling.get('type', 'default'))
  if kind == 'default':
    return theta, ()
  if kind != 'llama3':
    raise ValueError(f"{where}: RoPE type {kind!r} is not supported (only 'default' and 'llama3')")
  return theta, tuple(float(scaling[k]) for k in ('factor', 'low_freq_factor', 'high_freq_factor',
                                                   'original_max_position_embeddings'))


def model_fields(ref: str) -> dict:
  """The `config.model` fields of the checkpoint, read from its config.json (unsupported features refused)."""
  path = resolve(ref)
  c, where = _config(path), f'{path}/config.json'
  arch = (c.get('architectures') or ['?'])[0]
  if arch not in ARCHITECTURES:
    raise ValueError(f'{where}: architecture {arch!r} is not supported (one of {", ".join(ARCHITECTURES)})')
  unsupported = {'hidden_act': c.get('hidden_act', 'silu') != 'silu', 'mlp_bias': bool(c.get('mlp_bias')),
                 'num_experts': bool(c.get('num_experts') or c.get('num_local_experts')),
                 'attention_bias on the output projection': bool(c.get('attention_bias')) and arch != 'Qwen2ForCausalLM'}
  bad = [name for name, present in unsupported.items() if present]
  if bad:
    raise ValueError(f'{where}: {", ".join(bad)} {"is" if len(bad) == 1 else "are"} not supported')
  heads, dim = int(c['num_attention_heads']), int(c['hidden_size'])
  theta, scaling = _rope(c, where)
  return dict(vocab_size=int(c['vocab_size']), dim=dim, num_layers=int(c['num_hidden_layers']), num_heads=heads,
              num_kv_heads=int(c.get('num_key_value_heads') or heads), head_dim=int(c.get('head_dim') or dim // heads),
              mlp_dim=int(c['intermediate_size']), rope_base=theta, rope_interleaved=False, rope_scaling=scaling,
              qk_norm=arch == 'Qwen3ForCausalLM', attn_bias=arch == 'Qwen2ForCausalLM',
              tie_embeddings=bool(c.get('tie_word_embeddings', False)), norm_eps=float(c.get('rms_norm_eps', 1e-6)))


def sliding_window(ref: str) -> int | None:
  """The attention window the checkpoint uses, if any (None: full attention)."""
  c = _config(resolve(ref))
  if c.get('use_sliding_window') is False or c.get('sliding_window') is None:
    return None
  return int(c['sliding_window'])


def check_model_config(model: dict, ref: str) -> None:
  """Raise ValueError naming every `config.model` field that disagrees with the checkpoint."""
  want = model_fields(ref)
  same = lambda a, b: np.allclose(a, b, rtol=1e-6, atol=0) if isinstance(b, (float, tuple)) and b != () else a == b
  bad = [f'model.{k}={model.get(k)!r} (the checkpoint has {v!r})' for k, v in want.items()
         if not same(tuple(model.get(k) or ()) if k == 'rope_scaling' else model.get(k), v)]
  if (model.get('moe') or {}).get('num_experts'):
    bad.append(f"model.moe.num_experts={model['moe']['num_experts']} (the checkpoint is dense: 0)")
  window = sliding_window(ref)
  if window is not None and model['max_seq_len'] > window:
    bad.append(f"model.max_seq_len={model['max_seq_len']} exceeds the checkpoint's sliding attention window "
               f'({window}), which this model does not implement')
  if bad:
    raise ValueError(f'{resolve(ref)} does not fit this config: ' + '; '.join(bad))


# ---------------------------------------------------------------------------------------------
# Parameters


def _tensor_files(path: str) -> dict[str, str]:
  """Tensor name -> the shard that holds it (model.safetensors, or the shards its index names)."""
  index = os.path.join(path, 'model.safetensors.index.json')
  if os.path.isfile(index):
    with open(index, encoding='utf-8') as f:
      return {name: os.path.join(path, shard) for name, shard in json.load(f)['weight_map'].items()}
  files = sorted(glob.glob(os.path.join(path, '*.safetensors')))
  if not files:
    raise FileNotFoundError(f'{path} holds no .safetensors weights')
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  out = {}
  for name in files:
    with safe_open(name, framework='numpy') as f:
      out.update(dict.fromkeys(f.keys(), name))
  return out


def _hf_tensor(key: tuple) -> tuple[str, callable]:
  """The checkpoint tensor behind one of our parameters, and how it becomes ours (f: tensor, shape)."""
  t = lambda x, shape: np.ascontiguousarray(x.T).reshape(shape)  # (out, in) -> (in, ..., out, ...)
  same = lambda x, shape: x.reshape(shape)
  if key == ('embed',):
    return 'model.embed_tokens.weight', same
  if key == ('unembed',):
    return 'lm_head.weight', t
  if key == ('final_norm', 'scale'):
    return 'model.norm.weight', same
  _, i, *rest = key
  layer = f'model.layers.{i}.'
  names = {('attn_norm', 'scale'): ('input_layernorm.weight', same), ('mlp_norm', 'scale'): ('post_attention_layernorm.weight', same),
           ('attn', 'wq'): ('self_attn.q_proj.weight', t), ('attn', 'wk'): ('self_attn.k_proj.weight', t),
           ('attn', 'wv'): ('self_attn.v_proj.weight', t), ('attn', 'wo'): ('self_attn.o_proj.weight', t),
           ('attn', 'bq'): ('self_attn.q_proj.bias', same), ('attn', 'bk'): ('self_attn.k_proj.bias', same),
           ('attn', 'bv'): ('self_attn.v_proj.bias', same),
           ('attn', 'q_norm', 'scale'): ('self_attn.q_norm.weight', same),
           ('attn', 'k_norm', 'scale'): ('self_attn.k_norm.weight', same),
           ('mlp', 'w_gate'): ('mlp.gate_proj.weight', t), ('mlp', 'w_up'): ('mlp.up_proj.weight', t),
           ('mlp', 'w_down'): ('mlp.down_proj.weight', t)}
  if tuple(rest) not in names:
    raise ValueError(f'no checkpoint tensor for parameter {"/".join(map(str, key))}')
  name, f = names[tuple(rest)]
  return layer + name, f


def tensor_name(key: tuple) -> str:
  """The checkpoint's name of one of our trunk parameters, e.g. ('blocks', 3, 'attn', 'wq') ->
  model.layers.3.self_attn.q_proj.weight."""
  return _hf_tensor(key)[0]


def init_params(params: nnx.State, ref: str) -> nnx.State:
  """`params` with every trunk parameter read from the checkpoint, one tensor at a time, into the
  sharding of the parameter it replaces (MTP heads keep theirs)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  path = resolve(ref)
  files = _tensor_files(path)
  handles = {}

  def one(keypath, leaf):
    key = gguf_llama.param_key(keypath)
    if key[0] == 'mtp_heads':
      return leaf
    name, convert = _hf_tensor(key)
    if name not in files:
      raise ValueError(f'{path}: tensor {name!r} is missing (needed for {"/".join(map(str, key))})')
    if files[name] not in handles:
      handles[files[name]] = safe_open(files[name], framework='numpy')
    x = handles[files[name]].get_tensor(name).astype(np.float32)
    if x.size != leaf.size:
      raise ValueError(f'{path}: tensor {name} has shape {x.shape}, this model\'s {"/".join(map(str, key))} '
                       f'{leaf.shape}')
    value = convert(x, leaf.shape)
    sharding = getattr(leaf, 'sharding', None)
    return jax.device_put(value, sharding) if sharding is not None else value
  try:
    return jax.tree_util.tree_map_with_path(one, params)
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)


def load_model(ref: str, *, num_mtp_heads: int = 0, seed: int = 0, **overrides) -> MTPTransformer:
  """The checkpoint as an MTPTransformer (f32); heads, if any, keep a fresh init."""
  cfg = ModelConfig(**{**model_fields(ref), 'max_seq_len': 2048, **overrides}, num_mtp_heads=num_mtp_heads)
  graphdef, params = nnx.split(MTPTransformer(cfg, rngs=nnx.Rngs(seed)), nnx.Param)
  return nnx.merge(graphdef, jax.tree.map(jax.numpy.asarray, init_params(params, ref)))


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _chat_template(path: str, tokenizer_config: dict) -> str | None:
  """The chat template: chat_template.jinja (transformers 5 writes it there), else tokenizer_config.json's."""
  jinja = os.path.join(path, 'chat_template.jinja')
  if os.path.isfile(jinja):
    with open(jinja, encoding='utf-8') as f:
      return f.read()
  template = tokenizer_config.get('chat_template')
  if isinstance(template, list):  # named templates: the default one
    template = next((t['template'] for t in template if t.get('name') == 'default'), None)
  return template


def _token(value) -> str | None:
  return value.get('content') if isinstance(value, dict) else value


@functools.lru_cache(maxsize=4)
def load_tokenizer(ref: str) -> tokenizer_lib.Tokenizer:
  """The folder's tokenizer.json, its end-of-sequence token and chat template (tokenizer_config.json)."""
  path = resolve(ref)
  file = os.path.join(path, 'tokenizer.json')
  if not os.path.isfile(file):
    raise FileNotFoundError(f'{path} holds no tokenizer.json (a fast tokenizer is needed)')
  tk = tokenizer_lib.tokenizers_module()
  tok = tk.Tokenizer.from_file(file)
  settings = {}
  if os.path.isfile(os.path.join(path, 'tokenizer_config.json')):
    with open(os.path.join(path, 'tokenizer_config.json'), encoding='utf-8') as f:
      settings = json.load(f)
  eos = _token(settings.get('eos_token'))
  if eos is None:
    eos_id = _config(path).get('eos_token_id')
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    eos = tok.id_to_token(eos_id) if eos_id is not None else None
  if eos is None:
    raise ValueError(f'{path}: neither tokenizer_config.json nor config.json names an end-of-sequence token')
  # Documents are separated by <|endoftext|> where the vocabulary has it (an instruct model's eos,
  # <|im_end|>, also ends every turn inside a conversation), as for GGUF checkpoints.
  separator = tokenizer_lib.EOS if tok.token_to_id(tokenizer_lib.EOS) is not None else eos
  return tokenizer_lib.Tokenizer(tok, eos=separator, chat_template=_chat_template(path, settings),
                                 stop_tokens=(separator, eos))


def fingerprint(ref: str) -> str:
  """A short hash of the folder's tokenizer (vocabulary, merges, chat template)."""
  tok = load_tokenizer(ref)
  return hashlib.sha256((tok.to_str() + (tok.chat_template or '')).encode()).hexdigest()[:16]
