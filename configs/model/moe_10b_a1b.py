"""The paper's N10B-A1B MoE (Table 3: dim 1536, 32 heads, 4 kv heads, head_dim 128, untied, qk-norm).

Not in Table 3, our choices: 20 layers, each with 128 routed experts (top-4) and 1 shared expert,
all SwiGLU of width 768 (the dense-equivalent width per token is 5·768 = 3840 = 2.5·dim), and the
122,880-token vocabulary ([N]). That gives 9.80B parameters in total and 1.02B active per token
(K=0, embeddings counted; 0.38B of them the untied embedding and output head); one MTP head adds
0.48B total and 0.04B active. Coarse-ish experts (top-4 of width 768 rather than top-8 of 384)
keep the one-hot dispatch cheap next to the expert matmuls.
"""


def get_model():
  return {'vocab_size': 122_880, 'dim': 1536, 'num_layers': 20, 'num_heads': 32, 'num_kv_heads': 4,
          'head_dim': 128, 'mlp_dim': 768, 'qk_norm': True, 'tie_embeddings': False,
          'moe.num_experts': 128, 'moe.top_k': 4, 'moe.expert_dim': 768, 'moe.num_shared_experts': 1}
