"""Table 6 (K=4): "step weights", read as β_k varying with the head's depth k (our reading: docs/design.md, "Choices where the paper is silent")."""

from configs import paper


def get_config(arg: str = ''):
  c = paper.get_config(arg, num_mtp_heads=4)
  c.distill.beta = 0.5
  return c


def get_sweep():
  return [
      {'label': 'constant 0.5 (MTP-D)', 'distill.beta_schedule': 'constant'},
      {'label': 'exp decay 0.5·0.6^(k-1)', 'distill.beta_schedule': 'exp_decay'},
      {'label': 'linear decay', 'distill.beta_schedule': 'linear_decay'},
      {'label': 'linear increase', 'distill.beta_schedule': 'linear_increase'},
  ]
