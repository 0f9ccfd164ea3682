"""Export a workdir's trained MTP heads as safetensors with mtp_config.json (mtpd_jax/harness/export.py).

  python -m experiments.export --workdir=W --out=DIR

`train.init_from=DIR` then starts a run from the heads' base model with these heads, and the
folder can be shared without orbax. Prints what it wrote.
"""

import os

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string('workdir', None, 'a training workdir whose heads to export')
_OUT = flags.DEFINE_string('out', None, 'the folder to write mtp_heads.safetensors and mtp_config.json into')


def main(argv):
  if len(argv) > 1:
    raise ValueError(f'unexpected arguments {argv[1:]}: every setting is a --flag=value')
  if not _WORKDIR.value or not _OUT.value:
    raise ValueError('give --workdir (a training workdir) and --out (the folder to write)')
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  from configs import base
  from mtpd_jax.harness import export, training
  if not os.path.isdir(_WORKDIR.value):
    raise FileNotFoundError(f'--workdir={_WORKDIR.value} is not a directory')
  model, config = training.restore_model(_WORKDIR.value, defaults=base.get_config())
  meta = export.export_heads(model, config, training.head_vocab_of(_WORKDIR.value, config), _OUT.value)
  print(f"wrote {_OUT.value}/{export.WEIGHTS} ({meta['num_mtp_heads']} heads after layer {meta['first_layer']}) and "
        f"{export.CONFIG} (base {meta['base']['init_from'] or 'a fresh model'}, trunk sha256 "
        f"{meta['base']['trunk_sha256'][:12]}, head vocabulary "
        f"{'all ids' if meta['head_vocab'] is None else len(meta['head_vocab'])})", flush=True)


def run():
  from mtpd_jax.harness import cli
  cli.run(lambda: app.run(main, flags_parser=cli.parse_absl_flags))


if __name__ == '__main__':
  run()
