"""The dense model of configs/tiny.py, as a preset (switch any experiment to it, or back from a MoE)."""


def get_model():
  return {'dim': 64, 'num_layers': 2, 'num_heads': 4, 'num_kv_heads': 2, 'head_dim': 16, 'mlp_dim': 192,
          'qk_norm': True, 'tie_embeddings': False}
