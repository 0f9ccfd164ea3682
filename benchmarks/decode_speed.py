"""Tokens/s of self-speculative vs plain KV-cache greedy decoding: a tiny model, or a real GGUF llama.

  python -m benchmarks.decode_speed [--train_steps=300] [--depths=4,8] [--batch_sizes=1]
  python -m benchmarks.decode_speed --model=smollm2 [--workdir=DIR] [--batch_sizes=1,8] [--draft_vocab=0,4096]
  python -m benchmarks.decode_speed --depths=4,8 --draft_min_prob=0,0.3,0.6
  python -m benchmarks.decode_speed --depths=4 --tree=3,2,1,1
  python -m benchmarks.decode_speed --model=smollm2 --workdir=DIR --depths=1,2 --speculation=auto

--model=tiny (the default): a tiny model (8 layers, width 64) with K=4 heads is first trained for
a few hundred steps on the learnable synthetic stream of mtpd_jax.data (arithmetic progressions
mod V-1, EOS between documents) with CE losses on the main head and every MTP head, so that the
heads accept; a random model would accept ~0. Prompts are the openings of held-out records.
Depth 4 uses each head once, depth 8 loops them (training-free, MTP-D* of Table 8).

--model=smollm2 (or a llama .gguf path): the checkpoint with K=--num_mtp_heads heads, restored from a
training workdir of this project (--workdir: its trunk and trained heads), or else trained here
briefly with the trunk frozen: Adam on the heads only, CE of head k (position i -> token i+k+1)
over --train_steps batches of the embedded corpus in the checkpoint's tokenizer. Such heads are
weak; this measures the decoding engine, not the method. Prompts are the built-in chat, code and
math sets in the chat template; generation stops at the tokenizer's stop tokens. When transformers
is installed, the same prompts are also decoded one at a time by Hugging Face's `generate` (plain
and prompt-lookup; benchmarks/hf_generate.py) in this process, for tokens/s ratios and a
token-for-token comparison of the greedy outputs.

--draft_vocab=N drafts among the N most frequent tokens of the training text (the synthetic rows,
or the embedded corpus); verification still uses the whole vocabulary, so decoding stays lossless.
Heads of a --workdir trained over a head vocabulary (mtp.head_vocab) draft among its saved ids.
A list (`0,4096`) decodes every setting with each, side by side (keys `depthJ_dvN`), and
`draft_vocab_effect` gives each size's AR1 and tokens/s against the whole vocabulary's (0).

--draft_min_prob=p is adaptive depth: a sequence stops drafting at the first depth whose head's top
probability is below p (lossless; the logits of depths no sequence reaches are skipped). A list
(`0,0.5`) decodes every setting with each (keys `..._mpP`), and `adaptive_effect` gives each
threshold's tokens/forward and tokens/s against the full chain's (0).

--tree=b1,...,bJ also decodes each depth J equal to the tree's length with greedy tree drafts of
that branching (keys `..._tree`; mtpd_jax/drafting.py), and `tree_effect` gives its acceptance
length (accepted drafts per step) and tokens/s against the chain's.

--draft_source=context,both also decodes each chain with drafts from the context (prompt lookup,
no heads; keys `..._context`) and with the heads' chain beside the context's as one tree (keys
`..._both`; docs/design.md, "Drafts from the context"), over --ngram.

--speculation=auto also runs the speculation planner (mtpd_jax/harness/planner.py) per batch size,
on --calibration_prompts more prompts per set than the measured ones, and decodes every set with
its pick (key `auto`); `auto_effect` gives its speedup over plain beside the best fixed setting's.

Prints name=value lines and writes benchmarks/results/decode_speed.json (a GGUF model:
decode_speed_<name>.json), with the date and command.
"""

import dataclasses
import functools
import itertools
import os
import time
import types

import jax
import numpy as np
from absl import flags

from benchmarks import common, decode_effects
from benchmarks.tiny_heads import HEADS, TINY, synthetic_tokens, token_rows, train_mtp, train_tiny
from mtpd_jax import data, decode, drafting
from mtpd_jax.harness import cli, evaluate, planner

# Flags whose default depends on the model: (tiny, GGUF). depths '' = K.
MODE_DEFAULTS = {'train_steps': (300, 60), 'train_batch': (16, 4), 'train_seq': (64, 128), 'lr': (3e-3, 5e-4),
                 'depths': ('4,8', ''), 'batch_sizes': ('1', '1,8'), 'max_new_tokens': (128, 64),
                 'timing_steps': (256, 32), 'timing_repeats': (5, 2)}
PRINTED = ('tokens_per_forward', 'accept_len', 'plain_tokens_per_s', 'spec_tokens_per_s', 'plain_step_ms',
           'spec_step_ms', 'plain_wall_ms_per_step', 'spec_wall_ms_per_step', 'verify_cost_ratio',
           'speedup_measured', 'speedup_analytic', 'speedup_measured_over_analytic')


def _tiny_setup(args):
  """(model, prompt sets, stop tokens, pad multiple, draft-vocabulary source tokens, info)."""
  cfg = dataclasses.replace(TINY, num_layers=args.num_layers)
  start = time.perf_counter()
  model = train_tiny(cfg, steps=args.train_steps, batch_size=args.train_batch, seq_len=args.train_seq,
                     lr=args.lr, seed=args.seed)
  info = {'train_s': time.perf_counter() - start}
  rows = synthetic_tokens(cfg.vocab_size, args.prompt_len, range(args.num_prompts + args.calibration_prompts),
                          seed=1_000_003)
  info['calibration'] = list(rows[args.num_prompts:, :args.prompt_len])  # the planner's, never measured
  train_rows = lambda: synthetic_tokens(cfg.vocab_size, args.train_seq, range(args.train_steps * args.train_batch),
                                        args.seed)
  return model, {'synthetic': list(rows[:args.num_prompts, :args.prompt_len])}, (), 16, train_rows, info


def _gguf_setup(args):
  """(model, prompt sets, stop tokens, pad multiple, draft-vocabulary source tokens, info) of a GGUF llama."""
  from mtpd_jax.harness import corpus, gguf_llama, prompts, training
  path = gguf_llama.resolve(args.model)
  tok = gguf_llama.load_tokenizer(args.model)
  embedded = functools.cache(lambda: corpus.prepare_embedded(
      args.cache_dir or None, max_chars=args.train_chars, code_fraction=args.code_fraction, tokenizer=args.model))
  tokens = lambda: np.load(embedded().train_tokens_path)
  info, start = {'file': os.path.basename(path)}, time.perf_counter()
  if args.workdir:
    model, config = training.restore_model(args.workdir)
    gguf_llama.check_model_config(config.model.to_dict(), args.model)
    info['workdir'] = args.workdir
    ids = training.head_vocab_of(args.workdir, config)
    if ids is not None:  # heads trained over a head vocabulary draft among its ids, and only those
      if any(n not in (0, len(ids)) for n in args.draft_vocab):
        raise cli.InputError(f'--draft_vocab={args.draft_vocab}: the heads of {args.workdir} were trained over '
                             f'its {len(ids)} head-vocabulary ids and draft among those; leave --draft_vocab out')
      info['head_vocab_ids'] = ids
  else:
    model = gguf_llama.load_model(args.model, num_mtp_heads=args.num_mtp_heads, seed=args.seed)
    info['load_s'] = time.perf_counter() - start
    src = data.PackedTokens(embedded().train_tokens_path, args.train_seq, embedded().eos_id, model.cfg.vocab_size)
    order = np.random.default_rng(args.seed).permutation(len(src))
    rows = token_rows(src, order[np.arange(args.train_steps * args.train_batch) % len(src)])
    start = time.perf_counter()
    xent_SxK = train_mtp(model, rows, steps=args.train_steps, batch_size=args.train_batch, lr=args.lr,
                         trainable=HEADS, main_head=False)
    info.update(train_s=time.perf_counter() - start, train_tokens=int(rows.size), corpus_tokens=embedded().num_tokens)
    if len(xent_SxK):  # the last tenth of the steps: less batch noise
      info.update(train_xent_first=xent_SxK[0].tolist(),
                  train_xent_last=xent_SxK[-max(1, len(xent_SxK) // 10):].mean(0).tolist())
  sets = {name: prompts.load_prompt_set(name, tokenizer=tok, max_prompts=args.num_prompts + args.calibration_prompts,
                                        max_prompt_tokens=args.max_prompt_tokens, chat_template=True)
          for name in args.prompt_sets.split(',')}
  info['calibration'] = [p for ps in sets.values() for p in ps[args.num_prompts:]]  # the planner's, never measured
  sets = {name: ps[:args.num_prompts] for name, ps in sets.items()}
  return model, sets, tok.stop_ids, 64, tokens, info


FLAGS = flags.FlagValues()  # this benchmark's own flags: names may repeat across benchmarks
flags.DEFINE_string('model', 'tiny', "'tiny', 'smollm2' or a llama .gguf path", flag_values=FLAGS)
flags.DEFINE_string('workdir', '',
                    'GGUF: a training workdir whose trunk and heads are restored', flag_values=FLAGS)
flags.DEFINE_integer('num_mtp_heads', 4,
                     'GGUF: K heads trained here (a --workdir brings its own)', flag_values=FLAGS)
flags.DEFINE_integer('train_steps', None,
                     'Adam steps (tiny: 300 on the synthetic stream, GGUF: 60)', flag_values=FLAGS)
flags.DEFINE_integer('train_batch', None, 'rows per step (tiny: 16, GGUF: 4)', flag_values=FLAGS)
flags.DEFINE_integer('train_seq', None, 'tokens per row (tiny: 64, GGUF: 128)', flag_values=FLAGS)
flags.DEFINE_float('lr', None, 'Adam learning rate (tiny: 3e-3, GGUF: 5e-4)', flag_values=FLAGS)
flags.DEFINE_integer('train_chars', 2000000, 'GGUF: embedded corpus size in characters', flag_values=FLAGS)
flags.DEFINE_float('code_fraction', 0.25, 'GGUF: share of the corpus that is Python', flag_values=FLAGS)
flags.DEFINE_string('cache_dir', '',
                    "GGUF: embedded corpus cache ('' = ~/.cache/mtpd_jax)", flag_values=FLAGS)
flags.DEFINE_integer('seed', 0, 'initialisation and training-data order', flag_values=FLAGS)
flags.DEFINE_integer('num_layers', TINY.num_layers, 'tiny: trunk layers (a head: 1 block)', flag_values=FLAGS)
flags.DEFINE_string('depths', None,
                    'draft depths to benchmark (> K loops the heads; tiny: 4,8, GGUF: K)', flag_values=FLAGS)
flags.DEFINE_string('batch_sizes', None, 'prompts decoded together (tiny: 1, GGUF: 1,8)', flag_values=FLAGS)
flags.DEFINE_string('prompt_sets', 'chat,code,math', 'GGUF: built-in prompt sets', flag_values=FLAGS)
flags.DEFINE_integer('num_prompts', 8, 'prompts (tiny: held-out records; GGUF: per set)', flag_values=FLAGS)
flags.DEFINE_integer('prompt_len', 12, 'tiny: tokens per prompt', flag_values=FLAGS)
flags.DEFINE_integer('max_prompt_tokens', 256,
                     'GGUF: longest prompt, chat template included', flag_values=FLAGS)
flags.DEFINE_integer('max_new_tokens', None, 'new tokens per prompt (tiny: 128, GGUF: 64)', flag_values=FLAGS)
flags.DEFINE_string('draft_vocab', '0', 'draft among the N most frequent training tokens (0 = the whole '
                    'vocabulary); a list compares sizes side by side', flag_values=FLAGS)
flags.DEFINE_string('draft_min_prob', '0', 'adaptive depth: stop drafting below this top probability (0 = '
                    'the full chain); a list compares thresholds side by side', flag_values=FLAGS)
flags.DEFINE_string('tree', '', 'tree drafts beside the chain: branching per depth, e.g. 3,2,1,1 '
                    "('' = chains only)", flag_values=FLAGS)
flags.DEFINE_string('draft_source', 'heads', "who drafts, comma-separated: 'heads', 'context' (prompt lookup) "
                    "and/or 'both' (the two chains as one tree)", flag_values=FLAGS)
flags.DEFINE_integer('ngram', 3, 'context drafts: the longest suffix n-gram looked up', flag_values=FLAGS)
flags.DEFINE_string('speculation', '', "'auto': also decode with the speculation planner's pick per batch size "
                    '(chains up to the largest --depths, small trees, adaptive depth), calibrated on '
                    '--calibration_prompts more prompts (per set), and compare it with the best fixed setting',
                    flag_values=FLAGS)
flags.DEFINE_integer('calibration_prompts', 4, 'the planner: calibration prompts (per set) past --num_prompts',
                     flag_values=FLAGS)
flags.DEFINE_string('planner_cache', '', 'the planner: a folder caching step costs per model shape, device and '
                    "batch ('' = measure afresh)", flag_values=FLAGS)
flags.DEFINE_integer('repeats', 3, 'timed passes (the best counts)', flag_values=FLAGS)
flags.DEFINE_integer('timing_steps', None,
                     'steps of the per-step cost loops (tiny: 256, GGUF: 32)', flag_values=FLAGS)
flags.DEFINE_integer('timing_repeats', None,
                     'repeats of the per-step cost loops (tiny: 5, GGUF: 2)', flag_values=FLAGS)
flags.DEFINE_boolean('hf', True,
                     'GGUF: also time Hugging Face transformers at batch 1 (if installed)', flag_values=FLAGS)
flags.DEFINE_integer('lookup_tokens', 10, 'HF: prompt_lookup_num_tokens', flag_values=FLAGS)
flags.DEFINE_string('out', '',
                    'results JSON (default benchmarks/results/decode_speed[_<model>].json)', flag_values=FLAGS)


def _ints(args, name: str, lo: int, what: str) -> list[int]:
  """A --flag of comma-separated integers, each >= lo and distinct, or one line naming the flag."""
  value = getattr(args, name)
  try:
    out = [int(n) for n in str(value).split(',')]
  except ValueError:
    raise cli.InputError(f'--{name}={value} must be a comma-separated list of integers') from None
  if any(n < lo for n in out) or len(set(out)) != len(out):
    raise cli.InputError(f'--{name}={value} must be {what}')
  return out


def parse_args(argv=None) -> types.SimpleNamespace:
  """The flags from `argv` (default: the command line), every other flag at its default."""
  args = common.parse_flags(FLAGS, argv, __doc__)
  gguf = args.model != 'tiny'
  for name, values in MODE_DEFAULTS.items():
    if getattr(args, name) is None:
      setattr(args, name, values[gguf])
  if args.workdir and not gguf:
    raise cli.InputError('--workdir needs a GGUF --model (smollm2 or a .gguf path)')
  args.draft_vocab = _ints(args, 'draft_vocab', 0, 'distinct sizes >= 0')
  args.depths = _ints(args, 'depths', 1, 'distinct draft depths >= 1') if args.depths else []
  args.batch_sizes = _ints(args, 'batch_sizes', 1, 'distinct batch sizes >= 1')
  try:
    args.draft_min_prob = [float(p) for p in str(args.draft_min_prob).split(',')]
  except ValueError:
    raise cli.InputError(f'--draft_min_prob={args.draft_min_prob} must be a comma-separated list of numbers')
  if any(not 0 <= p <= 1 for p in args.draft_min_prob) or len(set(args.draft_min_prob)) != len(args.draft_min_prob):
    raise cli.InputError(f'--draft_min_prob={args.draft_min_prob} must be distinct numbers in [0, 1]')
  try:
    args.tree = tuple(int(b) for b in args.tree.split(',')) if args.tree else ()
  except ValueError:
    raise cli.InputError(f'--tree={args.tree} must be a comma-separated list of branchings') from None
  if any(b < 1 for b in args.tree):
    raise cli.InputError(f'--tree={args.tree} must be branchings >= 1')
  args.draft_source = args.draft_source.split(',')
  if not set(args.draft_source) <= set(drafting.SOURCES) or len(set(args.draft_source)) != len(args.draft_source):
    raise cli.InputError(f'--draft_source={",".join(args.draft_source)} must be distinct names from {drafting.SOURCES}')
  if args.ngram < 1:
    raise cli.InputError(f'--ngram={args.ngram} must be >= 1')
  if args.speculation not in ('', 'auto'):
    raise cli.InputError(f"--speculation={args.speculation} must be '' or 'auto'")
  if args.calibration_prompts < 1:
    raise cli.InputError(f'--calibration_prompts={args.calibration_prompts} must be >= 1')
  if args.out and not args.out.endswith('.json'):
    raise cli.InputError(f'--out={args.out} must name a .json file')
  if not args.out:
    name = 'smollm2' if args.model == 'smollm2' else os.path.splitext(os.path.basename(args.model))[0]
    args.out = os.path.join(common.RESULTS_DIR, 'decode_speed.json' if not gguf else f'decode_speed_{name}.json')
  return args


def _print(prefix: str, r: dict) -> None:
  for key in PRINTED:
    if key in r:
      print(f'{prefix}/{key}={r[key]:.4g}')
  print(f"{prefix}/lossless={r['lossless']}")
  print(f"{prefix}/car=" + ','.join(f'{x:.3f}' for x in r['car']))
  print(f"{prefix}/ar=" + ','.join(f'{x:.3f}' for x in r['ar']))


def fixed_settings(args: types.SimpleNamespace, depths, vocabs: dict, stop) -> tuple[dict, dict, dict]:
  """Every fixed decoding setting the flags ask for, once: ({key: DecodeOptions}, {chain key without
  the threshold: {threshold: key}}, {chain key: its tree's key})."""
  settings, chains, trees = {}, {}, {}
  for depth, (n, vocab), p, tree, source in itertools.product(depths, vocabs.items(), args.draft_min_prob,
                                                              dict.fromkeys(((), args.tree)), args.draft_source):
    if (tree and len(tree) != depth) or (source != 'heads' and (tree or (source == 'context' and p))):
      continue
    chain = f'depth{depth}' + (f'_dv{n}' if len(vocabs) > 1 else '')
    key = chain + (f'_mp{p:g}' if len(args.draft_min_prob) > 1 else '')
    if tree:
      trees[key] = key + '_tree'
      key += '_tree'
    elif source != 'heads':
      key += f'_{source}'
    else:
      chains.setdefault(chain, {})[p] = key
    settings[key] = decode.options(args.max_new_tokens, draft_depth=depth, tree=tree, draft_min_prob=p,
                                   draft_vocab=vocab, draft_source=source, ngram=args.ngram, stop_tokens=stop)
  return settings, chains, trees


def main(args: types.SimpleNamespace) -> dict:
  gguf = args.model != 'tiny'
  model, sets, stop, pad, train_tokens, info = (_gguf_setup if gguf else _tiny_setup)(args)
  head_ids, calibration = info.pop('head_vocab_ids', None), info.pop('calibration')
  vocabs = ({len(head_ids): head_ids} if head_ids is not None else
            {n: evaluate.frequent_tokens(np.ravel(train_tokens()), n) if n else None for n in args.draft_vocab})
  info['draft_vocab_source'] = 'the workdir\'s head vocabulary' if head_ids is not None else 'the training text'
  depths = args.depths or [model.cfg.num_mtp_heads]
  batch_sizes = args.batch_sizes
  results = {'model': args.model, 'num_mtp_heads': model.cfg.num_mtp_heads, **info, 'args': vars(args),
             'model_config': dataclasses.asdict(model.cfg), 'sets': {}, 'complete': False}
  settings, chains, trees = fixed_settings(args, depths, vocabs, stop)
  for name, prompts in sets.items():
    for b in batch_sizes:
      for key, opts in settings.items():
        r = evaluate.evaluate_prompt_set(model, prompts, opts, batch_size=b, pad_multiple=pad, repeats=args.repeats,
                                         timing_steps=args.timing_steps, timing_repeats=args.timing_repeats)
        r['speedup_measured_over_analytic'] = r['speedup_measured'] / r['speedup_analytic']
        if b == 1:  # where the time goes: per step of the timed runs, prefill and calls included
          plain_s, spec_s = (r['new_tokens'] / r[f'{m}_tokens_per_s'] for m in ('plain', 'spec'))
          r['plain_wall_ms_per_step'] = 1e3 * plain_s / max(r['new_tokens'] - len(prompts), 1)  # prefill emits one
          r['spec_wall_ms_per_step'] = 1e3 * spec_s / max(r['steps'], 1)
        results['sets'].setdefault(name, {}).setdefault(f'b{b}', {})[key] = r
        _print(f'{name}/b{b}/{key}', r)
      _checkpoint(args, results)
  if len(vocabs) > 1 and 0 in vocabs:
    results['draft_vocab_effect'] = decode_effects.draft_vocab_effect(results['sets'], depths, vocabs)
    for where, by_size in results['draft_vocab_effect'].items():
      for n, e in by_size.items():
        print(f"{where}/dv{n}/ar1_minus_full={e['ar1_minus_full']:+.4f} "
              f"{where}/dv{n}/spec_tokens_per_s_over_full={e['spec_tokens_per_s_over_full']:.3f}")
  if len(args.draft_min_prob) > 1 and 0 in args.draft_min_prob:
    results['adaptive_effect'] = decode_effects.adaptive_effect(results['sets'], chains)
    for where, by_p in results['adaptive_effect'].items():
      for p, e in by_p.items():
        print(f"{where}/mp{p:g}/tokens_per_forward={e['tokens_per_forward']:.3f} (full chain "
              f"{e['tokens_per_forward_full']:.3f}) {where}/mp{p:g}/spec_tokens_per_s_over_full="
              f"{e['spec_tokens_per_s_over_full']:.3f} lossless={e['lossless']}")
  if trees:
    results['tree_effect'] = decode_effects.tree_effect(results['sets'], trees)
    for where, e in results['tree_effect'].items():
      print(f"{where}/tree{','.join(map(str, args.tree))}/accept_len={e['accept_len']:.3f} (chain "
            f"{e['accept_len_chain']:.3f}) {where}/tree/spec_tokens_per_s_over_chain="
            f"{e['spec_tokens_per_s_over_chain']:.3f} lossless={e['lossless']}")
  if args.speculation == 'auto' and not calibration:
    raise cli.InputError('--speculation=auto calibrates on prompts past --num_prompts, and no prompt set has '
                         'more: lower --num_prompts')
  if args.speculation == 'auto':  # the planner's pick per batch size, timed against plain on every set
    vocab = next((v for v in vocabs.values() if v is not None), None)
    # a speculative base keeps the draft vocabulary (plain options carry none): the candidates draft over it
    base = decode.options(args.max_new_tokens, draft_depth=max(depths), draft_vocab=vocab, ngram=args.ngram,
                          stop_tokens=stop)
    tpf = None  # acceptance, measured by the first plan and reused: it does not depend on the batch size
    for b in batch_sizes:
      _checkpoint(args, results)
      choice = planner.plan(model, calibration, base, batch_size=b, pad_multiple=pad, max_depth=max(depths),
                            cache_dir=args.planner_cache or None, tokens_per_forward=tpf)
      tpf = {name: r['tokens_per_forward'] for name, r in choice.rows.items()}
      for name, prompts in sets.items():
        results['sets'][name][f'b{b}']['auto'] = planner.measure(model, prompts, choice, batch_size=b,
                                                                 pad_multiple=pad, repeats=args.repeats)
    results['auto_effect'] = decode_effects.auto_effect(results['sets'])
    for where, e in results['auto_effect'].items():
      print(f"{where}/auto={e['setting']} speedup={e['speedup']:.3f} best_fixed={e['best_fixed']} "
            f"({e['best_fixed_speedup']:.3f}) over_best_fixed={e['over_best_fixed']:.3f} lossless={e['lossless']}")
  if gguf and args.hf:
    from benchmarks import hf_generate  # pylint: disable=import-outside-toplevel
    if 1 not in batch_sizes:
      results['hf'] = 'skipped: the comparison is at batch 1, which --batch_sizes leaves out'
    elif not hf_generate.available():
      results['hf'] = 'skipped: transformers or torch is not installed (requirements-hf.txt)'
    else:
      from mtpd_jax.harness import gguf_llama  # pylint: disable=import-outside-toplevel
      first = chains[f'depth{depths[0]}' + (f'_dv{args.draft_vocab[0]}' if len(vocabs) > 1 else '')][
          args.draft_min_prob[0]]
      b1 = {name: results['sets'][name]['b1'][first] for name in sets}
      results.update(hf_generate.side_by_side(model, gguf_llama.resolve(args.model), sets, b1, stop=stop,
                                     pad_multiple=pad, args=args))
    if isinstance(results.get('hf'), str):
      print(f"hf={results['hf']}")
  results['complete'] = True
  _write(args, results)
  return results


def _write(args: types.SimpleNamespace, results: dict) -> None:
  out = os.path.abspath(args.out)
  common.write_results(os.path.splitext(os.path.basename(out))[0], results, os.path.dirname(out))


def _checkpoint(args: types.SimpleNamespace, results: dict) -> None:
  """Write what is measured so far (`complete` stays False until the end), and drop the compiled
  programs: a SmolLM2 run of every setting and the planner's candidates at two batch sizes
  otherwise held enough of them that LLVM could no longer allocate (it died at the batch-8 plan)."""
  _write(args, results)
  jax.clear_caches()


if __name__ == '__main__':
  cli.run(lambda: main(parse_args()))  # bad input: one 'error:' line, exit 2
