"""The paper's 2B dense model (Table 3: dim 2048, 16 heads, 4 kv heads, head_dim 128, untied, qk-norm).

Not in Table 3, our choices: 32 layers and SwiGLU width 6144 (3·dim), which with the 122,880-token
vocabulary (the paper's base-model description; docs/design.md, "Architectures") give 2.05B
parameters (K=0; 0.50B of them the untied embedding and output head), 2.10B with one MTP head.
"""


def get_model():
  return {'vocab_size': 122_880, 'dim': 2048, 'num_layers': 32, 'num_heads': 16, 'num_kv_heads': 4,
          'head_dim': 128, 'mlp_dim': 6144, 'qk_norm': True, 'tie_embeddings': False}
