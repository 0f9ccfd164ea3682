"""Views for notebooks: a speculative generation split into its steps, with accepted drafts marked.

The prefill pass chooses the first new token; each speculative step then emits the drafts the
main head accepted followed by one token of the main head itself (its correction, or the bonus
token when every draft was accepted). The last step may be cut by a stop token or the token limit.
"""

import html
from collections.abc import Callable, Sequence

import numpy as np

DRAFT_STYLE = 'background:#c8e6c9'   # accepted drafts
MAIN_STYLE = 'border-bottom:2px solid #90a4ae'  # the main head's token of a step


def step_chunks(tokens: Sequence[int], accept_lengths: Sequence[int]) -> list[tuple[list[int], int]]:
  """(tokens emitted, how many of them are accepted drafts) for prefill and then every step."""
  tokens = [int(t) for t in tokens]
  chunks, pos = [(tokens[:1], 0)], min(1, len(tokens))
  for a in np.asarray(accept_lengths, int):
    if pos >= len(tokens):
      break
    chunk = tokens[pos:pos + a + 1]
    chunks.append((chunk, min(int(a), len(chunk))))
    pos += len(chunk)
  if pos != len(tokens):
    raise ValueError(f'{len(tokens)} tokens but the {len(accept_lengths)} steps account for {pos}')
  return chunks


def highlight_html(tokens: Sequence[int], accept_lengths: Sequence[int],
                   detokenize: Callable[[Sequence[int]], str]) -> str:
  """HTML of the generated text: accepted drafts shaded, each step's main-head token underlined."""
  spans = []
  for chunk, accepted in step_chunks(tokens, accept_lengths):
    if accepted:
      spans.append(f'<span style="{DRAFT_STYLE}">{html.escape(detokenize(chunk[:accepted]))}</span>')
    if len(chunk) > accepted:
      spans.append(f'<span style="{MAIN_STYLE}">{html.escape(detokenize(chunk[accepted:]))}</span>')
  return ('<div style="white-space:pre-wrap;font-family:monospace">' + ''.join(spans) + '</div>'
          f'<div style="font-size:small"><span style="{DRAFT_STYLE}">accepted drafts</span> · '
          f'<span style="{MAIN_STYLE}">main head</span></div>')


def speedup_lines(eval_results: dict) -> list[str]:
  """One line per prompt set of an `eval.json` ('prompt_sets'): AR1, tokens per forward, speedup."""
  lines = []
  for name, r in eval_results['prompt_sets'].items():
    lines.append(f'{name}: AR1 {100 * r["ar"][0]:.1f}%, {r["tokens_per_forward"]:.2f} tokens/forward, '
                 f'speedup {r["speedup_measured"]:.2f}x measured ({r["speedup_analytic"]:.2f}x analytic), '
                 f'lossless={r["lossless"]}')
  return lines


def speculative_html(workdir: str, prompt_set: str = 'chat', index: int = 0, *, max_new_tokens: int = 64,
                     draft_depth: int = 0) -> str:
  """Greedy speculative decoding of one prompt of a trained workdir's prompt set, as highlighted HTML.

  Needs a text source (`data.source='embedded'` or 'text'); draft_depth 0 drafts with all K heads.
  """
  from mtpd_jax import decode  # pylint: disable=import-outside-toplevel
  from mtpd_jax.harness import recipe, training
  model, config = training.restore_model(workdir)
  tok = recipe.tokenizer(config)
  if tok is None:
    raise ValueError(f'{workdir} was trained on data.source={config.data.source!r}, which has no text to show')
  prompt = recipe.prompt_sets(config)[prompt_set][index]
  gen = decode.generate(model, [prompt], max_new_tokens=max_new_tokens,
                        draft_depth=draft_depth or config.model.num_mtp_heads,
                        stop_tokens=tok.stop_ids)
  return (f'<pre style="white-space:pre-wrap;color:#555">{html.escape(tok.decode(prompt))}</pre>'
          + highlight_html(gen.tokens[0], gen.accept_lengths[0], tok.decode))
