"""mtpd_jax: multi-token-prediction heads trained by self-distillation (MTP-D), in JAX and Flax NNX.

The core (this package's modules) never reads a config; the harness (`mtpd_jax.harness`) translates
one into the core's frozen dataclasses (docs/design.md, "Two layers").

Dimension legend, the one for every module: an array's name ends in its axes (`logits_BxTxV`),
and einsum strings use the same letters in lower case. A letter means one kind of axis everywhere;
a digit after it adds that many (`J1` = J + 1), a leading digit multiplies (`2D`), a bare digit is
an axis of that size (`a_Seedsx3`), and a function that works over any leading axes names only the
trailing ones it reads (`probs(logits_V)`). The letters, for the axes that carry the arithmetic:

  B  batch: sequences, or prompts                K  MTP heads (K1: the main head and the K heads)
  D  model width                                 N  top-N entries of a row (the paper's N)
  E  attention head width                        R  rows: positions flattened over the batch
  F  MLP or expert width                         S  key positions (KV-cache slots)
  G  kv heads                                    T  query positions
  H  attention heads                             U  draft-vocabulary entries
  J  draft depth (drafts per speculative step)   V  vocabulary

An axis that lives in one or two modules is a capitalised word instead of a letter
(`nodes_BxNodes`, `choice_GroupsxRxChosenxExperts`); an einsum names it by a lower-case letter that
its line's comment or its function's docstring gives. The words:

  Children  drafts of one tree node (its branching)
  Chosen    experts chosen per token (the router's top-k)
  Draws     bootstrap resamples
  Experts   routed experts
  Groups    groups of consecutive rows (loss chunks, MoE routing groups)
  In, Out   a dense layer's input and output features
  Members   ensemble members (the ensemble-mean teacher)
  Nodes     nodes of a draft tree
  Parents   one tree depth's parent nodes, over every batch row
  Paths     root-to-leaf paths of a draft tree
  Prompts   prompts of a prompt set
  Qheads    query heads per kv head (H / G)
  Seeds     seeds of a sweep's row
  Slots     capacity slots of an expert
  Steps     decoding steps
  Window    positions of one decoding step's window
"""
