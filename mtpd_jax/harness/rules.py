"""The rule builders of config validation: a `Rule` says what one field accepts (its doc for the
config reference) and, given a value and the config, what the value should be when it is not."""

import math
import numbers
from typing import Any, Callable, NamedTuple


class Rule(NamedTuple):
  doc: str                                  # what the field accepts, for the config reference
  bad: Callable[[Any, Any], str | None]     # (value, config) -> None, or what the value should be


def field(config, name: str):
  for key in name.split('.'):
    config = config[key]
  return config


def is_int(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:  # finite: NaN and inf are refused everywhere
  return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _limit(config, bound) -> tuple[Any, str]:
  """A bound and its words: 8 -> (8, '8'); 'model.vocab_size' -> (8192, 'model.vocab_size=8192')."""
  if isinstance(bound, str):
    value = field(config, bound)
    return value, f'{bound}={value}'
  return bound, f'{bound}'


def integer(lo: int, hi=None, *, below=None) -> Rule:
  """An int >= lo, and <= hi or < below (an int or a field name)."""
  doc = f'int >= {lo}' if hi is None and below is None else (
      f'int in [{lo}, {hi}]' if below is None else f'int in [{lo}, {below})')

  def bad(v, c):
    top = None if hi is None and below is None else _limit(c, below if hi is None else hi)
    if is_int(v) and v >= lo and (top is None or (v <= top[0] if below is None else v < top[0])):
      return None
    return (f'an int >= {lo}' if top is None else
            f'an int in [{lo}, {top[1]}]' if below is None else f'an int in [{lo}, {top[1]})')
  return Rule(doc, bad)


def real(lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False) -> Rule:
  """A finite number in the interval from lo to hi (None = unbounded), open or closed at each end."""
  words = ('a finite number' if lo is None and hi is None else
           f'a finite number {">" if lo_open else ">="} {lo}' if hi is None else
           f'a finite number in {"(" if lo_open else "["}{lo}, {hi}{")" if hi_open else "]"}')

  def bad(v, c):
    ok = is_real(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (
        hi is None or (v < hi if hi_open else v <= hi))
    return None if ok else words
  return Rule(words.removeprefix('a '), bad)


def flag() -> Rule:
  return Rule('True | False', lambda v, c: None if isinstance(v, bool) else 'True or False')


def text() -> Rule:
  return Rule('str', lambda v, c: None if isinstance(v, str) else 'a string')


def one_of(*choices) -> Rule:
  return Rule(' | '.join(map(repr, choices)), lambda v, c: None if v in choices else f'one of {choices}')


def optional(rule: Rule) -> Rule:
  return Rule(f'None | {rule.doc}', lambda v, c: None if v is None else (
      None if rule.bad(v, c) is None else f'None or {rule.bad(v, c)}'))
