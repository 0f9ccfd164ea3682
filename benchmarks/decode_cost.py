"""Where a decoding step's time goes, against the time of reading the bytes it must read.

  python -m benchmarks.decode_cost [--model=smollm2|tiny|PATH.gguf] [--batch_sizes=1,8] [--depths=0,1,2,4,8]

For each batch size, every draft depth J is timed side by side in one process (`evaluate.step_seconds`:
jitted loops of steps, settings alternating, best of repeats), J = 0 being plain decoding. The parts
of a step are then jitted and timed alone at the same shapes: the verify trunk (J+1 positions over
the KV cache), the verify logits (J+1 rows), one draft depth's head block (a 2J-position window) and
its logits (one row; over the draft vocabulary with --draft_vocab). `rest` is the step less those parts
(state bookkeeping, cache writes, masks, sampling). Heads are random: only costs are measured.
With --standard_layout (the default) every setting is also timed with the matrices in their
training layout, x @ W (keys `..._standard`, and spec_over_plain_j1_standard etc.), alternating
with the decoding default (out-major on CPU, W @ x^T: decode.split, docs/design.md "Decoding cost").

The memory bound: at batch 1 a step reads the trunk, the unembedding once per verified batch of rows
and once per draft depth, each head block once, and the KV caches. `read_gb_per_s` is a jitted sum
over as many bytes as the plain step reads, timed back to back with the plain step in each of
--repeats rounds (`read_rounds`); `plain_over_bound` is the median over rounds of the plain step over
that read, and each setting's `over_bound` its step over the time of reading its bytes at the median
rate. Tree shapes (--trees) are timed beside the chain of their depth (`treeAxB`, `chainJ`, over the
draft vocabulary when --draft_vocab is set), each step split into drafting, verify, accept and
commit (`phases_ms`). Headline keys: spec_over_plain_j1, spec_over_plain_j4 (batch 1),
plain_over_bound. Writes benchmarks/results/decode_cost.json.
"""

import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from benchmarks import common
from mtpd_jax import decode, drafting, verify
from mtpd_jax.harness import cli, evaluate, gguf_llama
from mtpd_jax.model import ModelConfig, MTPTransformer, cache_mask, init_cache

TINY = ModelConfig(vocab_size=256, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                   mlp_dim=192, num_mtp_heads=4, max_seq_len=512)


FLAGS = flags.FlagValues()  # this benchmark's own flags: names may repeat across benchmarks
flags.DEFINE_string('model', 'smollm2',
                    "'smollm2', a llama .gguf path, or 'tiny' (a quick check)", flag_values=FLAGS)
flags.DEFINE_integer('num_mtp_heads', 4, 'K random MTP heads (depths above K loop them)', flag_values=FLAGS)
flags.DEFINE_string('batch_sizes', '1,8', 'sequences decoded together, a list', flag_values=FLAGS)
flags.DEFINE_string('depths', '0,1,2,4,8', 'draft depths J; 0 = plain (always timed)', flag_values=FLAGS)
flags.DEFINE_integer('prompt_len', 64, 'prompt tokens (the cache holds these + new)', flag_values=FLAGS)
flags.DEFINE_integer('max_new_tokens', 128, 'new tokens (sizes the KV cache)', flag_values=FLAGS)
flags.DEFINE_integer('draft_vocab', 0, "also time J=4 with drafts over the V' lowest ids", flag_values=FLAGS)
flags.DEFINE_boolean('standard_layout', True, 'also time every setting with the matrices in their '
                     'training layout (x @ W), beside the default out-major one on CPU (decode.split)',
                     flag_values=FLAGS)
flags.DEFINE_string('trees', '1,1;3,1;1,3;3,2', "tree shapes (branching per depth, ';' between trees) timed "
                    "beside the chains, with each step split into drafting, verify, accept and commit; '' = none",
                    flag_values=FLAGS)
flags.DEFINE_integer('steps', 32, 'timed steps per loop', flag_values=FLAGS)
flags.DEFINE_integer('repeats', 3, 'timed repeats of each loop (the best counts)', flag_values=FLAGS)
common.define_results_dir(FLAGS)


def parse_args(argv=None) -> types.SimpleNamespace:
  """The flags from `argv` (default: the command line), every other flag at its default."""
  return common.parse_flags(FLAGS, argv, __doc__)


def _best_ms(f, *args, repeats: int = 5) -> float:
  jax.block_until_ready(f(*args))
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    best = min(best, time.perf_counter() - start)
  return 1e3 * best


def read_rounds(model: MTPTransformer, prompts, nbytes: int, args) -> tuple[list, list]:
  """Per round, this machine's read rate (GB/s: a jitted sum over `nbytes` of f32) and the plain step
  over the time of that read, the two timed back to back in each of `args.repeats` rounds: the read
  rate of these shared machines drifts (29-48 GB/s between runs), so both must see the same state."""
  buf = jnp.ones(nbytes // 4, jnp.float32)
  total = jax.jit(jnp.sum)
  plain = {'j0': decode.options(args.max_new_tokens)}
  rates, ratios = [], []
  for _ in range(max(args.repeats, 1)):
    read_s = _best_ms(total, buf) / 1e3
    step_s = evaluate.step_seconds(model, prompts, plain, pad_multiple=16, num_steps=args.steps, repeats=1)['j0']
    rates.append(buf.nbytes / read_s / 1e9)
    ratios.append(step_s / read_s)
  return rates, ratios


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def parts_ms(model: MTPTransformer, b: int, j: int, s: int, vocab_size: int, repeats: int) -> dict:
  """Milliseconds of each part of one step at batch b, depth j and cache length s, jitted alone."""
  structure, leaves = decode.split(model)
  cfg = model.cfg
  pos0 = s // 2  # a cache half full
  caches = init_cache(cfg, b, s, cfg.num_layers)

  @jax.jit
  def verify_trunk(leaves, caches):
    pos_BxT = jnp.broadcast_to(pos0 + jnp.arange(j + 1), (b, j + 1))
    return structure.merge(leaves).trunk(jnp.ones((b, j + 1), jnp.int32), pos_BxT, cache_mask(pos_BxT, s), caches)

  @jax.jit
  def logits(leaves, h_BxTxD, cols):
    model = structure.merge(leaves)
    return model.logits(h_BxTxD, None if cols is None else drafting.draft_vocab(model, cols).w)

  out = {'verify_trunk': _best_ms(verify_trunk, leaves, caches, repeats=repeats),
         'verify_logits': _best_ms(logits, leaves, jnp.ones((b, j + 1, cfg.dim)), None, repeats=repeats)}
  if j:
    w = 2 * j
    head_cache = init_cache(cfg, b, s, 1)[0]

    @jax.jit
    def draft_block(leaves, cache):
      pos_BxWindow = jnp.broadcast_to(pos0 - w + jnp.arange(w), (b, w))
      return structure.merge(leaves).mtp_head(1, jnp.ones((b, w, cfg.dim)), jnp.ones((b, w), jnp.int32),
                                              pos_BxWindow, cache_mask(pos_BxWindow, s), cache)
    cols = None if vocab_size >= cfg.vocab_size else jnp.arange(vocab_size)
    out['draft_block_per_depth'] = _best_ms(draft_block, leaves, head_cache, repeats=repeats)
    out['draft_logits_per_depth'] = _best_ms(logits, leaves, jnp.ones((b, 1, cfg.dim)), cols, repeats=repeats)
  return out


def phases_ms(model: MTPTransformer, prompts, opts, repeats: int) -> dict:
  """Milliseconds of each phase of one speculative step (a chain's or a tree's), each jitted alone on
  the state a few steps into decoding: `verify` (the trunk and main logits over the verified
  nodes in one tree attention pass, a chain's being its drafts), `accept` (choosing the path and
  what is accepted along it, and for a tree copying that path's cache slots into place), `draft`
  (the head passes) and `commit`, the whole step less those three (writing the emitted tokens and hidden states)."""
  structure, leaves = decode.split(model)
  plan, j = opts.draft, opts.draft.depth
  prompt_BxT, lens_B = decode.pad_prompts(prompts, 16)
  st = decode.jit_steps(structure, leaves, decode.jit_prefill(structure, leaves, prompt_BxT, lens_B,
                                                              jax.random.key(0), opts), opts, 4, False)
  vocab = lambda m: drafting.draft_vocab(m, plan.vocab) if plan.vocab else None

  @jax.jit
  def verify_nodes(leaves, st):
    model = decode.decoding_model(structure, leaves)
    return verify.verify_pass(model, st.nodes_BxNodes, st.length_B, st.caches, plan)

  @jax.jit
  def accept(st, verified):
    _, logits, caches = verified
    path, a, nxt = verify.accept(jax.random.key(0), st.nodes_BxNodes, None, logits, plan, 0.0)
    return path, a, nxt, verify.keep_path(caches, st.length_B, path, plan)

  @jax.jit
  def draft(leaves, st):
    m = decode.decoding_model(structure, leaves)
    start = jnp.maximum(st.length_B - 1 - 2 * j, 0)
    return drafting.draft(m, plan, st.tokens_BxS, st.length_B, st.h0_BxSxD, st.head_caches, start, 2 * j,
                          jax.random.key(0), vocab(m), 0.0, 1.0)
  step = jax.jit(lambda leaves, st: decode.step(decode.decoding_model(structure, leaves), st, opts,
                                                vocab(decode.decoding_model(structure, leaves))))
  out = {'verify': _best_ms(verify_nodes, leaves, st, repeats=repeats),
         'accept': _best_ms(accept, st, verify_nodes(leaves, st), repeats=repeats),
         'draft': _best_ms(draft, leaves, st, repeats=repeats), 'step': _best_ms(step, leaves, st, repeats=repeats)}
  out['commit'] = out['step'] - out['verify'] - out['accept'] - out['draft']
  return out


def _trees(value: str) -> list[tuple[int, ...]]:
  try:
    return [tuple(int(b) for b in t.split(',')) for t in value.split(';') if t.strip()]
  except ValueError:
    raise cli.InputError(f"--trees={value} must be trees of branchings, e.g. '1,1;3,2'") from None


def step_bytes(model: MTPTransformer, b: int, j: int, s: int, draft_vocab: int) -> dict:
  """Bytes a step must read: trunk, unembedding (verify), per depth a head block and draft columns, KV caches."""
  cfg = model.cfg
  params = nnx.state(model, nnx.Param)
  unembed = cfg.dim * cfg.vocab_size * 4
  heads = _nbytes(params['mtp_heads']) if cfg.num_mtp_heads else 0
  trunk = _nbytes(params) - heads - (0 if cfg.tie_embeddings else cfg.dim * cfg.vocab_size * 4) - (
      cfg.vocab_size * cfg.dim * 4)
  kv = 2 * b * cfg.num_kv_heads * s * cfg.head_dim * 4
  head_block = heads // max(cfg.num_mtp_heads, 1)
  draft_cols = (draft_vocab or cfg.vocab_size) * cfg.dim * 4
  return {'trunk': trunk, 'unembedding': unembed, 'kv_cache': cfg.num_layers * kv,
          'drafts': j * (head_block + draft_cols + kv),
          'total': trunk + unembed + cfg.num_layers * kv + j * (head_block + draft_cols + kv)}


def main(args: types.SimpleNamespace) -> dict:
  if args.model == 'tiny':
    model = MTPTransformer(TINY, rngs=nnx.Rngs(0))
  else:
    model = gguf_llama.load_model(args.model, num_mtp_heads=args.num_mtp_heads)
  cfg = model.cfg
  depths = sorted({0, *map(int, args.depths.split(','))})
  results = {'model': args.model, 'batches': {}}
  rng = np.random.default_rng(0)
  for b in map(int, args.batch_sizes.split(',')):
    prompts = [rng.integers(1, cfg.vocab_size, args.prompt_len) for _ in range(b)]
    settings = {f'j{j}': decode.options(args.max_new_tokens, draft_depth=j) for j in depths}
    if args.draft_vocab and 4 in depths:
      settings['j4_draft_vocab'] = decode.options(args.max_new_tokens, draft_depth=4,
                                                  draft_vocab=np.arange(args.draft_vocab))
    vocab = np.arange(args.draft_vocab) if args.draft_vocab else None
    trees = {f"tree{'x'.join(map(str, t))}": decode.options(args.max_new_tokens, draft_depth=len(t), tree=t,
                                                           draft_vocab=vocab) for t in _trees(args.trees)}
    chains = {f'chain{len(t)}': decode.options(args.max_new_tokens, draft_depth=len(t), draft_vocab=vocab)
              for t in _trees(args.trees)}
    settings.update({**chains, **trees})
    # The same settings with x @ W (`_standard`), alternating with the default layout's.
    standard = {f'{name}_standard': opts for name, opts in settings.items()
                if name.startswith('j')} if args.standard_layout else {}
    seconds = evaluate.step_seconds(model, prompts, {**settings, **standard}, pad_multiple=16,
                                    num_steps=args.steps, repeats=args.repeats,
                                    out_major=dict.fromkeys(standard, False))
    p = -(-args.prompt_len // 16) * 16
    if 'read_gb_per_s' not in results:  # measured beside the first batch size's plain step
      plain_bytes = step_bytes(model, b, 0, decode.cache_len(p, settings['j0']), 0)['total']
      rates, ratios = read_rounds(model, prompts, plain_bytes, args)
      results.update(read_gb_per_s=float(np.median(rates)), read_gb_per_s_rounds=rates,
                     plain_over_bound=float(np.median(ratios)))
    row = {name: {'step_ms': 1e3 * seconds[name], 'over_plain': seconds[name] / seconds['j0']}
           for name in {**chains, **trees}}
    for name, opts in settings.items():
      if name in row:
        continue
      j = opts.draft.depth
      s = decode.cache_len(p, opts)
      dv = len(opts.draft.vocab)
      parts = parts_ms(model, b, j, s, dv or cfg.vocab_size, args.repeats)
      step_ms = 1e3 * seconds[name]
      parts['rest'] = step_ms - parts['verify_trunk'] - parts['verify_logits'] - j * (
          parts.get('draft_block_per_depth', 0) + parts.get('draft_logits_per_depth', 0))
      nbytes = step_bytes(model, b, j, s, dv)
      bound_ms = 1e3 * nbytes['total'] / (results['read_gb_per_s'] * 1e9)
      row[name] = {'step_ms': step_ms, 'parts_ms': parts, 'bytes': nbytes, 'bound_ms': bound_ms,
                   'over_bound': step_ms / bound_ms, 'over_plain': step_ms / (1e3 * seconds['j0'])}
    for name in standard:
      row[name] = {'step_ms': 1e3 * seconds[name], 'over_plain': seconds[name] / seconds['j0_standard']}
    for name, opts in {**chains, **trees}.items():  # where a chain's and a tree's step goes
      row[name]['phases_ms'] = phases_ms(model, prompts, opts, args.repeats)
      row[name]['paths'], row[name]['nodes'] = opts.draft.paths, opts.draft.verified
    results['batches'][b] = row
    for name, r in row.items():
      results[f'b{b}/{name}/step_ms'] = r['step_ms']
      results[f'b{b}/{name}/over_plain'] = r['over_plain']
      if 'over_bound' in r:
        results[f'b{b}/{name}/over_bound'] = r['over_bound']
  first = results['batches'][int(args.batch_sizes.split(',')[0])]
  for j in (1, 4):
    for suffix in ('', '_standard'):
      if f'j{j}{suffix}' in first:
        results[f'spec_over_plain_j{j}{suffix}'] = first[f'j{j}{suffix}']['over_plain']
  common.write_results('decode_cost', results, args.results_dir)
  return results


if __name__ == '__main__':
  cli.run(lambda: main(parse_args()))  # bad input: one 'error:' line, exit 2
