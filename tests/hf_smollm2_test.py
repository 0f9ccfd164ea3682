"""SmolLM2 as a Hugging Face folder: transformers loads the embedded GGUF and saves it with
`save_pretrained` (safetensors, tokenizer.json, chat template; transformers will not save a model it
holds as GGUF, so its dequantized f32 weights go into a plain model first); our `hf:` import of that
folder gives the logits of our GGUF import, and its tokenizer transformers' ids on every prompt set."""

import os
import subprocess
import sys

import numpy as np
import pytest

from mtpd_jax.harness import corpus, gguf_llama, hf_llama

pytest.importorskip('transformers')
pytestmark = pytest.mark.slow  # transformers loads and saves a 135M model in a subprocess
SAVE = """
import os, sys
os.environ['HF_HUB_OFFLINE'] = '1'
import torch, transformers
d, name = os.path.split(sys.argv[1])
transformers.AutoTokenizer.from_pretrained(d, gguf_file=name).save_pretrained(sys.argv[2])
gguf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
config = gguf.config
if hasattr(config, 'quantization_config'):  # the dequantized weights are plain f32: save them as such
  del config.quantization_config
plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
plain.load_state_dict(gguf.state_dict())
plain.save_pretrained(sys.argv[2])
"""


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('smollm2-hf'))
  proc = subprocess.run([sys.executable, '-c', SAVE, gguf_llama.resolve('smollm2'), out], capture_output=True,
                        text=True, timeout=600, env={**os.environ, 'OMP_NUM_THREADS': '1'})
  assert proc.returncode == 0, proc.stderr[-3000:]
  return 'hf:' + out


def test_the_saved_folder_gives_the_gguf_imports_logits(folder):
  fields = hf_llama.model_fields(folder)
  assert {k: v for k, v in gguf_llama.model_fields('smollm2').items() if k != 'rope_interleaved'} == {
      k: v for k, v in fields.items() if k not in ('rope_interleaved', 'rope_scaling', 'attn_bias')}
  assert fields['rope_interleaved'] is False  # transformers un-permutes llama.cpp's Q/K rows
  tok = gguf_llama.load_tokenizer('smollm2')
  tokens = np.asarray([tok.encode('The capital of France is Paris. The capital of Germany is')[:12],
                       tok.encode('def fibonacci(n):\n    if n < 2:\n        return n')[:12]], np.int32)
  want = np.asarray(gguf_llama.load_model('smollm2')(tokens).logits_BxTxV)
  got = np.asarray(hf_llama.load_model(folder)(tokens).logits_BxTxV)
  assert np.abs(got - want).max() <= 1e-4


def test_the_saved_tokenizer_gives_transformers_ids_on_every_prompt_set(folder):
  """The folder's tokenizer.json and chat template, read by us, give the ids transformers gives for
  the same folder. (They are transformers' conversion of the GGUF tokenizer, which merges some
  whitespace that llama.cpp's pre-tokenizer, which our GGUF import rebuilds, splits: the folder's
  ids need not be the GGUF import's.)"""
  import transformers  # pylint: disable=import-outside-toplevel
  theirs = transformers.AutoTokenizer.from_pretrained(folder[len('hf:'):])
  ours = hf_llama.load_tokenizer(folder)
  assert theirs.convert_ids_to_tokens(ours.stop_ids[-1]) == theirs.eos_token
  for name in corpus.PROMPT_SETS:
    for text in corpus.prompt_texts(name)[:64]:
      if name == 'chat':
        want = theirs.apply_chat_template([{'role': 'user', 'content': text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        got = ours.chat_prompt(ours.encode(text))
      else:
        want, got = theirs.encode(text, add_special_tokens=False), ours.encode(text)
      assert list(got) == list(want), (name, text[:80])
