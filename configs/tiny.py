"""A CPU-sized twin of base: main + K=4 heads under MTP-D on the synthetic source, in about a minute."""

from configs import base


def get_config():
  c = base.get_config()
  c.model.vocab_size = 256
  c.model.dim = 64
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.mlp_dim = 192
  c.model.max_seq_len = 128
  c.model.num_mtp_heads = 4
  c.distill.top_n = 21            # ≈ 8.1% of V, as the paper's 10,000 of 122,880
  c.data.seq_len = 64
  c.data.batch_size = 8
  c.data.synthetic_records = 4096
  c.train.steps = 300
  c.train.lr = 3e-3               # a tiny model on a simple source tolerates a larger step
  c.train.log_every = 10
  c.ckpt.every_steps = 100
  c.eval.max_prompts = 8
  c.eval.max_prompt_tokens = 16
  c.eval.max_new_tokens = 48
  return c
