"""Parity of our GGUF import with an independent implementation: Hugging Face transformers on PyTorch.

  python -m benchmarks.hf_parity [--ref=smollm2] [--out=benchmarks/results/hf_parity.json]

Both load the same GGUF checkpoint (SmolLM2-135M-Instruct by default) in f32 on the CPU: ours
through mtpd_jax.harness.gguf_llama (interleaved RoPE on the GGUF row order, tied embeddings), theirs
through `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`, offline. For a few prompts,
one of them a ChatML conversation from the model's chat template, it compares the token ids of
both tokenizers and the logits of every position. Prints name=value lines, the last being
`max_abs_logit_diff=<x>`, and writes benchmarks/results/hf_parity.json (or --out). Needs requirements-hf.txt.
"""

import json
import os
import time

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # never reach a hub: the GGUF file is local

import jax
import numpy as np
from absl import flags
from flax import nnx

from benchmarks import common
from mtpd_jax.harness import gguf_llama

RESULTS = os.path.join(os.path.dirname(__file__), 'results', 'hf_parity.json')
TEXTS = (
    'The capital of France is Paris. The capital of Germany is',
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n',
    'In 1969, 3 astronauts flew 384,400 km to the Moon; 2 of them walked on it for ~21.5 hours.',
)
CHAT = [{'role': 'user', 'content': 'What is 17 * 23? Explain step by step.'}]


def hf_load(path: str):
  """(tokenizer, model) of transformers for a local GGUF file, f32, eval mode."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  d, name = os.path.split(os.path.abspath(path))
  tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
  return tok, model.eval()


def _ids(x) -> list[int]:
  return list(x['input_ids'] if hasattr(x, 'keys') else x)


def compare(ref: str = 'smollm2', texts=TEXTS, chat=CHAT) -> dict:
  """Token-id agreement and the largest |logit difference| over all prompts and positions."""
  import torch  # pylint: disable=import-outside-toplevel
  path = gguf_llama.resolve(ref)
  t0 = time.perf_counter()
  hf_tok, hf_model = hf_load(path)
  hf_load_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  tok = gguf_llama.load_tokenizer(ref)
  model = gguf_llama.load_model(ref, dtype='float32')
  ours_load_s = time.perf_counter() - t0
  ours_ids = [tok.encode(t) for t in texts] + [tok.chat_prompt(tok.encode(chat[0]['content']))]
  hf_ids = ([_ids(hf_tok(t, add_special_tokens=False)) for t in texts]
            + [_ids(hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True))])
  # The weights are an argument, not constants closed over: baked into the program, they made the
  # persistent compilation cache compress a 540 MB executable (88 s of the test's 130 s).
  graphdef, params = nnx.split(model)
  forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens).logits_BxTxV)
  # Every prompt is right-padded to one length, so the 30-layer forward compiles once; causal
  # attention keeps the padding out of the positions compared.
  t_pad = max(map(len, ours_ids))
  diffs, top1_agree, positions = [], 0, 0
  for ids in ours_ids:  # both models read our ids, so a tokenizer mismatch cannot hide a logit one
    ours = np.asarray(forward(params, np.asarray([ids + [0] * (t_pad - len(ids))], np.int32)))[0, :len(ids)]
    with torch.no_grad():
      theirs = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    diffs.append(float(np.max(np.abs(ours - theirs))))
    top1_agree += int(np.sum(ours.argmax(-1) == theirs.argmax(-1)))
    positions += len(ids)
  return {'ref': ref, 'file': os.path.basename(path), 'prompts': len(ours_ids), 'positions': positions,
          'tokens_equal': ours_ids == hf_ids,
          'tokens_equal_per_prompt': [a == b for a, b in zip(ours_ids, hf_ids)],
          'max_abs_logit_diff_per_prompt': diffs, 'top1_agreement': top1_agree / positions,
          'hf_load_s': hf_load_s, 'ours_load_s': ours_load_s, 'max_abs_logit_diff': max(diffs)}


FLAGS = flags.FlagValues()
flags.DEFINE_string('ref', 'smollm2', "'smollm2' or a llama .gguf path", flag_values=FLAGS)
flags.DEFINE_string('out', RESULTS, 'where the JSON result goes', flag_values=FLAGS)


def main():
  args = common.parse_flags(FLAGS, None, __doc__)
  result = compare(args.ref)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(result, f, indent=2)
  for key in ('file', 'prompts', 'positions', 'tokens_equal', 'top1_agreement', 'hf_load_s', 'ours_load_s',
              'max_abs_logit_diff'):
    print(f'{key}={result[key]}')


if __name__ == '__main__':
  from mtpd_jax.harness import cli
  cli.run(main)  # bad input: one 'error:' line, exit 2
