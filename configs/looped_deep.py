"""Table 8's deeper loops and Fig. 14: four MTP-D heads looped to 8 and to 16, against 1-head MTP.

The paper cites "4 heads looped to 8: 3.052x" and "4 heads looped to 16: 3.204x" (Table 8 and
Fig. 14). Rows: 1-head MTP (the baseline), MTP-D with K=4 (loop "4"), training-free looping of
those four heads to depth 16 (MTP-D*), and trained iterated doubling 4 -> 8 and 4 -> 8 -> 16 (each
stage copies the trained heads, freezes everything else and trains the copies with the MTP-D loss).
"""

from configs import paper


def get_config(arg: str = ''):
  c = paper.get_config(arg, num_mtp_heads=4)
  c.looped.stage_steps = c.train.steps // 2
  return c


def get_sweep():
  return [
      {'label': 'MTP, K=1 (baseline)', 'model.num_mtp_heads': 1, 'distill.enabled': False},
      {'label': 'MTP-D, K=4'},
      {'label': 'MTP-D*, 4 to 16 (training-free)', 'eval.draft_depth': 16},
      {'label': 'MTP-D, 4 to 8 (trained)', 'looped.schedule': (4, 8)},
      {'label': 'MTP-D, 4 to 16 (trained, 4 -> 8 -> 16)', 'looped.schedule': (4, 8, 16)},
  ]
