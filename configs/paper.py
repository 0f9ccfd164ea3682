"""Shared set-up of the paper's experiments on the embedded default data (no download).

Text: ShareGPT chat plus Python standard-library source, byte-level BPE of 8,192 tokens.
Protocol: a plain LM is pretrained once (`base.steps`, cached) and each variant continues from
it with main model and heads training jointly, as the paper's continued pre-training; then real
speculative decoding on held-out chat, code and math prompts. Sized for a laptop CPU;
`NAME:quick` shrinks everything so a whole sweep runs in minutes (smoke runs, CI, notebooks).
"""

from configs import base


def get_config(arg: str = ''):
  c = base.get_config()
  c.data.source = 'embedded'
  c.data.seq_len = 128
  c.data.batch_size = 16
  c.model.max_seq_len = 512
  c.base.steps = 1000
  c.train.steps = 400
  c.train.lr = 1e-3
  c.train.log_every = 20
  c.ckpt.every_steps = 200
  c.eval.max_prompts = 16
  c.eval.max_prompt_tokens = 96
  c.eval.max_new_tokens = 64
  if arg == 'quick':
    c.model.update(dict(dim=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=192))
    c.data.seq_len, c.data.batch_size = 64, 8
    c.base.steps, c.train.steps = 60, 30
    c.train.log_every, c.ckpt.every_steps = 10, 30
    c.train.eval_batches = 2
    c.eval.max_prompts, c.eval.max_prompt_tokens, c.eval.max_new_tokens = 4, 32, 16
  elif arg:
    raise ValueError(f"unknown config argument {arg!r}; expected '' or 'quick'")
  return c
