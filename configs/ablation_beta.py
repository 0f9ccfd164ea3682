"""Tables 6 and 7 and Fig. 9 (K=4): the KL weight β_k, constant over heads (paper default 0.5)."""

from configs import paper


def get_config(arg: str = ''):
  return paper.get_config(arg, num_mtp_heads=4)


DEFAULT = 'beta = 0.5 (default)'  # the reference of the other β's paired differences (MTP is the default's)


def get_sweep():
  return ([{'label': 'MTP', 'distill.enabled': False}]
          + [{'label': f'beta = {b}', 'distill.beta': b, 'reference': DEFAULT} if b != 0.5 else
             {'label': DEFAULT, 'distill.beta': b} for b in (0.1, 0.3, 0.5, 1.0, 1.5)])
