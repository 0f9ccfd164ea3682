"""Shared set-up of the paper's experiments on the embedded default data (no download).

Text: ShareGPT chat plus Python standard-library source, byte-level BPE of 8,192 tokens.
Protocol: a plain LM is pretrained once (`base.steps`, cached) and each variant continues from
it with main model and heads training jointly, as the paper's continued pre-training; then real
speculative decoding on held-out chat, code and math prompts. Sized for two CPU cores
(docs/results.md gives each sweep's wall time); `NAME:quick` shrinks everything to a smoke run
(CI, notebooks).
"""

from configs import base


def get_config(arg: str = '', *, num_mtp_heads: int = 1):
  c = base.get_config()
  c.model.num_mtp_heads = num_mtp_heads
  c.data.source = 'embedded'
  c.model.update(dict(dim=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
                      max_seq_len=512))
  c.data.seq_len, c.data.batch_size = 128, 8
  c.base.steps, c.train.steps = 400, 150
  c.train.lr = 1e-3
  c.train.log_every, c.ckpt.every_steps = 10, 50
  c.eval.max_prompts, c.eval.max_prompt_tokens, c.eval.max_new_tokens = 8, 64, 48
  if arg == 'quick':
    c.model.update(dict(dim=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, mlp_dim=192))
    c.data.seq_len = 32
    c.base.steps, c.train.steps = 40, 20
    c.train.log_every, c.ckpt.every_steps = 5, 20
    c.train.eval_batches = 2
    c.eval.max_prompts, c.eval.max_prompt_tokens, c.eval.max_new_tokens = 4, 32, 16
    c.eval.batch_size = 4
    c.eval.repeats, c.eval.timing_steps, c.eval.timing_repeats = 1, 32, 2  # smoke timings
  elif arg:
    raise ValueError(f"unknown config argument {arg!r}; expected '' or 'quick'")
  return c
