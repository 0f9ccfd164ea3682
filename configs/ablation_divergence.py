"""Beyond the paper: the distillation divergence. MTP-D's KL (Eq. 5) against total variation and
Jensen-Shannon over the same Top-N selection, with plain MTP beside them, at K=1 and K=4.

Drafter recipes published since argue that a divergence tied to acceptance beats the KL: under
speculative sampling a draft is accepted with probability 1 - TV(teacher, student), and these
runs verify greedily, where acceptance is the argmax match (docs/design.md, "Divergences").
Every row uses the paper's default β (1.0 at K=1, 0.5 per head at K=4); TV and JS are bounded
(by 1 and log 2), so their gradients are smaller than the KL's at the same β.
"""

from configs import paper


def get_config(arg: str = ''):
  return paper.get_config(arg)


def get_sweep():
  rows = []
  for k in (1, 4):  # paired differences: KL against MTP, TV and JS against KL, at the same K
    mtp, kl = f'MTP, K={k}', f'MTP-D (KL), K={k}'
    rows += [
        {'label': mtp, 'model.num_mtp_heads': k, 'distill.enabled': False, 'reference': mtp},  # none
        {'label': kl, 'model.num_mtp_heads': k, 'distill.divergence': 'kl', 'reference': mtp},
        {'label': f'TV, K={k}', 'model.num_mtp_heads': k, 'distill.divergence': 'tv', 'reference': kl},
        {'label': f'JS, K={k}', 'model.num_mtp_heads': k, 'distill.divergence': 'js', 'reference': kl},
    ]
  return rows
