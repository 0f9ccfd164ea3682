"""Hugging Face checkpoint folders against transformers itself: small random Llama (with Llama 3's
RoPE scaling, tied), Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k norm) models saved by
`save_pretrained` give transformers' logits; what we do not implement is refused in one line."""

import json
import os

import numpy as np
import pytest

from mtpd_jax.harness import hf_llama

transformers = pytest.importorskip('transformers')
torch = pytest.importorskip('torch')
os.environ.setdefault('HF_HUB_OFFLINE', '1')

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
CONFIGS = {
    'llama3_scaled_tied': lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True, rope_scaling={
        'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
        'original_max_position_embeddings': 16}),
    'mistral': lambda: transformers.MistralConfig(**SMALL, sliding_window=None, rope_theta=5e4),
    'qwen2': lambda: transformers.Qwen2Config(**SMALL),
    'qwen3': lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
}


def _save(name, path):
  """A random model of `name`'s architecture saved as a folder; norms and biases random too."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if 'norm' in pname or pname.endswith('bias'):
        p.normal_(1.0 if 'norm' in pname else 0.0, 0.5)
  model.save_pretrained(path)
  return model


@pytest.mark.parametrize('name', CONFIGS)
def test_a_saved_folder_gives_the_logits_of_transformers(tmp_path, name):
  theirs = _save(name, tmp_path)
  ours = hf_llama.load_model(f'hf:{tmp_path}', max_seq_len=64)
  fields = hf_llama.model_fields(f'hf:{tmp_path}')
  assert fields['attn_bias'] == (name == 'qwen2') and fields['qk_norm'] == (name == 'qwen3')
  assert bool(fields['rope_scaling']) == (name == 'llama3_scaled_tied') and fields['tie_embeddings'] == ('tied' in name)
  tokens = np.random.default_rng(1).integers(0, 96, (2, 48))  # past the scaled model's original 16 positions
  with torch.no_grad():
    want = theirs(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(ours(tokens).logits_BxTxV)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_what_is_not_implemented_is_refused_in_one_line(tmp_path):
  _save('qwen2', tmp_path)
  config = json.loads((tmp_path / 'config.json').read_text())
  cases = [({'architectures': ['GPT2LMHeadModel']}, "architecture 'GPT2LMHeadModel' is not supported"),
           ({'hidden_act': 'gelu'}, 'hidden_act is not supported'),
           ({'num_local_experts': 8}, 'num_experts is not supported'),
           ({'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 1e4, 'factor': 4.0}},
            "RoPE type 'yarn' is not supported")]
  for i, (change, message) in enumerate(cases):
    folder = tmp_path / str(i)
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
      hf_llama.model_fields(f'hf:{folder}')
  windowed = tmp_path / 'windowed'
  windowed.mkdir()
  (windowed / 'config.json').write_text(json.dumps({**config, 'use_sliding_window': True, 'sliding_window': 32}))
  model = {**hf_llama.model_fields(f'hf:{windowed}'), 'max_seq_len': 64}
  with pytest.raises(ValueError, match='exceeds the checkpoint\'s sliding attention window'):
    hf_llama.check_model_config(model, f'hf:{windowed}')
  hf_llama.check_model_config({**model, 'max_seq_len': 32}, f'hf:{windowed}')  # inside the window: exact
  with pytest.raises(ValueError, match=r'model.num_layers=3 \(the checkpoint has 2\)'):
    hf_llama.check_model_config({**model, 'max_seq_len': 32, 'num_layers': 3}, f'hf:{windowed}')
  with pytest.raises(FileNotFoundError, match='not a Hugging Face checkpoint folder'):
    hf_llama.model_fields(f'hf:{tmp_path / "nowhere"}')


def test_a_recipe_takes_the_shape_and_tokenizer_of_the_folder_it_starts_from(tmp_path):
  """smollm2_mtpd with `train.init_from=hf:<a Qwen2 folder>`: the model's shape is the folder's, and
  the recipe's own pretrained tokenizer ('smollm2') gives way to the folder's, unless the command
  line names one; a shape the command line sets against the folder is refused in one line."""
  from configs import smollm2_mtpd
  from mtpd_jax.harness import pretrained
  _save('qwen2', tmp_path)
  ref = f'hf:{tmp_path}'
  config = smollm2_mtpd.get_config('quick')
  config.train.init_from = ref
  pretrained.derive_model(config, {'train.init_from'})
  assert (config.model.vocab_size, config.model.dim, config.model.num_layers, config.model.attn_bias) == (
      96, 32, 2, True)
  assert config.data.tokenizer == ref
  kept = smollm2_mtpd.get_config('quick')
  kept.train.init_from = ref
  pretrained.derive_model(kept, {'train.init_from', 'data.tokenizer'})
  assert kept.data.tokenizer == 'smollm2'  # named on the command line: the user's choice stands
  clash = smollm2_mtpd.get_config('quick')
  clash.train.init_from = ref
  with pytest.raises(ValueError, match=r'contradicts the command line: model.dim=576 \(the checkpoint has 32\)'):
    pretrained.derive_model(clash, {'train.init_from', 'model.dim'})
