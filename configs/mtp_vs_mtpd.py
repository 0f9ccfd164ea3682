"""Tables 1 and 5: plain MTP (CE only) against MTP-D, with K=1 and K=4 heads, on the dense model and
(K=1, as the paper's A1B rows) on a Mixture-of-Experts twin of it."""

from configs import paper

# The MoE rows' trunk: the dense rows' attention and width, and every feed-forward replaced by 8
# routed experts (top-2) plus 1 shared expert, all of width 96. Per token it runs 288 of the 864
# expert width, against the dense model's 384: fewer active and more total parameters, as the
# paper's A1B MoE against its 2B dense. Its base model is pretrained separately (the cache key is
# the model config).
MOE = {'model.moe.num_experts': 8, 'model.moe.top_k': 2, 'model.moe.expert_dim': 96,
       'model.moe.num_shared_experts': 1}


def get_config(arg: str = ''):
  return paper.get_config(arg)


def get_sweep():
  return [
      {'label': 'MTP, K=1', 'model.num_mtp_heads': 1, 'distill.enabled': False},
      {'label': 'MTP-D, K=1', 'model.num_mtp_heads': 1, 'distill.enabled': True},
      {'label': 'MTP, K=4', 'model.num_mtp_heads': 4, 'distill.enabled': False},
      {'label': 'MTP-D, K=4', 'model.num_mtp_heads': 4, 'distill.enabled': True, 'reference': 'MTP, K=4'},
      {'label': 'MTP, K=1, MoE', 'model.num_mtp_heads': 1, 'distill.enabled': False, **MOE},
      {'label': 'MTP-D, K=1, MoE', 'model.num_mtp_heads': 1, 'distill.enabled': True, **MOE,
       'reference': 'MTP, K=1, MoE'},
  ]
