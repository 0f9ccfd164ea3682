"""One process of a CPU training run on a (4, 2) mesh of 8 devices in all (for distributed_test.py).

  python tests/distributed_worker.py --out=OUT.npz --workdir=DIR --local_devices=8
  python tests/distributed_worker.py ... --local_devices=4 --coordinator=127.0.0.1:PORT --num_processes=2 --process_id=I
  (--steps=N runs N steps; a SIGTERM checkpoints and exits 143, and a rerun resumes)

It runs `train_and_evaluate` with checkpoints in DIR. Process 0 writes the per-step losses, the
final eval loss and the final parameters (gathered to the host, keyed `param<path>`) to OUT.npz.
"""

import argparse
import json
import os
import sys
import traceback

NUM_STEPS = 4


def parse_args(argv):
  """The command line above; --coordinator makes this process one of --num_processes."""
  p = argparse.ArgumentParser()
  p.add_argument('--out', required=True)
  p.add_argument('--workdir', required=True, help='checkpoints and metrics.jsonl')
  p.add_argument('--local_devices', type=int, required=True)
  p.add_argument('--coordinator')
  p.add_argument('--num_processes', type=int, default=1)
  p.add_argument('--process_id', type=int, default=0)
  p.add_argument('--steps', type=int, default=NUM_STEPS, help='train steps')
  return p.parse_args(argv)


if __name__ == '__main__':
  ARGS = parse_args(sys.argv[1:])
  os.environ['JAX_NUM_CPU_DEVICES'] = str(ARGS.local_devices)  # before jax is imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpd_jax import runtime
from mtpd_jax.harness import training

from tests.conftest import small_config


def worker_config(steps: int = NUM_STEPS):
  """The tiny config on a (4, 2) fsdp x model mesh, logging every step, checkpointing mid-run."""
  c = small_config(steps=steps)
  c.mesh.shape, c.mesh.axes = (4, 2), ('fsdp', 'model')
  # Adam's first steps are ±lr for any |g| >> eps, which turns reduction-order noise (gloo vs
  # in-process all-reduce) in near-zero gradients into lr-sized jumps; see train_test.py.
  c.train.eps = 1e-3
  c.train.log_every = 1
  c.ckpt.every_steps = 2
  return c


def host_params(params) -> dict[str, np.ndarray]:
  """Every parameter as a whole numpy array (on every process), keyed `param<path>`.

  One jitted gather of the whole tree: gathering leaf by leaf compiles a program per leaf, which
  on a loaded machine took minutes.
  """
  replicated = jax.tree.map(lambda x: NamedSharding(x.sharding.mesh, P()), params)
  gathered = jax.jit(lambda t: t, out_shardings=replicated)(params)
  return {'param' + jax.tree_util.keystr(path): np.asarray(x.addressable_data(0))
          for path, x in jax.tree_util.tree_leaves_with_path(gathered)}


def run_train(config, workdir: str) -> dict[str, np.ndarray]:
  """`train_and_evaluate` into `workdir`: logged per-step losses, final eval loss and parameters."""
  state, final = training.train_and_evaluate(config, workdir, progress=False)
  out = dict(eval_loss=np.asarray(final['eval/loss']), **host_params(state.params))
  if jax.process_index() == 0:  # only process 0 writes metrics.jsonl
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      out['losses'] = np.asarray([r['train/loss'] for r in map(json.loads, f) if 'train/loss' in r])
  return out


def main(args):
  """Join the pair when asked, train, and (process 0) save the results."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # before any computation
  if args.coordinator:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               initialization_timeout=60)
  config = worker_config(args.steps)
  out = run_train(config, args.workdir)
  if jax.process_index() == 0:
    np.savez(args.out, process_count=jax.process_count(), device_count=jax.device_count(),
             local_device_count=jax.local_device_count(), **out)
  if jax.process_count() > 1:
    runtime.sync_processes('distributed_worker done')
    jax.distributed.shutdown()


if __name__ == '__main__':
  import faulthandler
  import signal
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks before killing a hung pair
  from mtpd_jax.runtime import Preempted
  try:
    main(ARGS)
  except Preempted as e:  # checkpointed: the usual 128+signal status, as experiments/run.py exits
    print(e, flush=True)
    os._exit(128 + e.signum)
  except BaseException:  # noqa: BLE001  (exit now: jax.distributed's exit-time shutdown waits for the peer)
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
