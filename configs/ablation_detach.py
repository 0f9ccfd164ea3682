"""Table 2 (K=1): the gradient-detached teacher against "no detach", with plain MTP for reference."""

from configs import paper


def get_config(arg: str = ''):
  return paper.get_config(arg, num_mtp_heads=1)


def get_sweep():
  return [
      {'label': 'MTP', 'distill.enabled': False},
      {'label': 'MTP-D (detach)', 'distill.detach': True},
      {'label': 'no detach', 'distill.detach': False, 'train.loss_chunk_rows': 0,  # the fused loss needs detach
       'reference': 'MTP-D (detach)'},
  ]
