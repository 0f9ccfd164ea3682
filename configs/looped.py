"""Table 8 and Figs. 3 and 5: looped extension to 8 heads, against 1-head MTP.

Rows: 1-head MTP (the baseline), MTP-D with K=1 and K=4, training-free looping of the K=1 MTP-D
head to depth 8 (MTP-D*), and trained looping 1 -> 2 -> 4 -> 8 (each stage copies the trained
heads, freezes everything else and trains the copies) with the MTP and with the MTP-D loss.
"""

from configs import paper


def get_config(arg: str = ''):
  c = paper.get_config(arg, num_heads=1)
  c.looped.stage_steps = c.train.steps // 2
  return c


def get_sweep():
  trained = {'looped.schedule': (1, 2, 4, 8), 'eval.draft_depth': 8}
  return [
      {'label': 'MTP, K=1 (baseline)', 'distill.enabled': False},
      {'label': 'MTP-D, K=1', 'distill.enabled': True},
      {'label': 'MTP-D, K=4', 'mtp.num_heads': 4},
      {'label': 'MTP-D*, 1 to 8 (training-free)', 'eval.draft_depth': 8},
      {'label': 'MTP, 1 to 8 (trained)', 'distill.enabled': False, **trained},
      {'label': 'MTP-D, 1 to 8 (trained)', **trained},
  ]
