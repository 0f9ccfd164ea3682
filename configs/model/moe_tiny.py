"""A CPU-sized MoE twin of configs/tiny.py's model: 4 routed experts (top-2) and 1 shared expert.

Each expert is SwiGLU of width 96, so a token runs 3·96 = 288 of the 480 expert width (tiny's
dense MLP: 192). The vocabulary stays the experiment's.
"""


def get_model():
  return {'dim': 64, 'num_layers': 2, 'num_heads': 4, 'num_kv_heads': 2, 'head_dim': 16, 'mlp_dim': 192,
          'qk_norm': True, 'tie_embeddings': False,
          'moe.num_experts': 4, 'moe.top_k': 2, 'moe.expert_dim': 96, 'moe.num_shared_experts': 1}
