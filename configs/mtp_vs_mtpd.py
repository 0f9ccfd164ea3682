"""Tables 1 and 5: plain MTP (CE only) against MTP-D, with K=1 and K=4 heads."""

from configs import paper


def get_config(arg: str = ''):
  return paper.get_config(arg)


def get_sweep():
  return [
      {'label': 'MTP, K=1', 'mtp.num_heads': 1, 'distill.enabled': False},
      {'label': 'MTP-D, K=1', 'mtp.num_heads': 1, 'distill.enabled': True},
      {'label': 'MTP, K=4', 'mtp.num_heads': 4, 'distill.enabled': False},
      {'label': 'MTP-D, K=4', 'mtp.num_heads': 4, 'distill.enabled': True},
  ]
