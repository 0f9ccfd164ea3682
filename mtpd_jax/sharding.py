"""Device mesh, the one table of logical-axis rules, and the shardings of state and batches.

Mesh axes: `data` (pure data parallel: params replicated), `fsdp` (data parallel with params and
optimizer moments sharded over `embed`), `expert` (expert parallel: MoE experts split over it, the
batch too, so it is data parallel for everything else), `model` (tensor parallel over vocab, heads
and MLP; it also splits the experts when there is no `expert` axis, or what that leaves).
Parameters carry logical axis names (model.py); `AXIS_RULES` maps them onto mesh axes.
"""

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'expert', 'model')

# logical name -> mesh axes it is split over (in order); a name not listed is replicated.
AXIS_RULES = {
    'batch': ('data', 'fsdp', 'expert'),
    'embed': ('fsdp',),
    'vocab': ('model',),
    'heads': ('model',),
    'kv_heads': ('model',),
    'mlp': ('model',),            # an expert's width: only if 'model' is not taken by 'expert' below
    'expert': ('expert', 'model'),
}


def resolve_mesh_shape(shape, axes, num_devices: int) -> tuple[int, ...]:
  """Fill one -1 entry so the mesh covers every device; raise ValueError on any mismatch."""
  shape, axes = tuple(int(s) for s in shape), tuple(axes)
  if len(shape) != len(axes):
    raise ValueError(f'mesh.shape {shape} and mesh.axes {axes} differ in length')
  unknown = [a for a in axes if a not in MESH_AXES]
  if unknown or len(set(axes)) != len(axes):
    raise ValueError(f'mesh.axes {axes}: each must be one of {MESH_AXES}, at most once')
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f'mesh.shape {shape}: positive sizes and at most one -1')
  known = math.prod(s for s in shape if s != -1)
  if num_devices % known:
    raise ValueError(f'mesh.shape {shape} does not divide the {num_devices} devices')
  shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(f'mesh.shape {shape} uses {math.prod(shape)} devices, but {num_devices} are present')
  return shape


def mesh_device_count(shape) -> int:
  """Devices a mesh of `shape` uses: all, or in one process a fixed shape's product if it is smaller."""
  fixed = -1 not in tuple(shape) and jax.process_count() == 1 and 0 < math.prod(shape) <= jax.device_count()
  return math.prod(shape) if fixed else jax.device_count()


def make_mesh(shape, axes, devices=None) -> jax.sharding.Mesh:
  """A mesh over `devices` (default: all devices of all processes), with Auto axis types.

  In a single process, a fixed shape smaller than the device count uses the first devices.
  """
  axis_types = (AxisType.Auto,) * len(axes)
  if devices is None and mesh_device_count(shape) < jax.device_count():
    devices = jax.devices()[:mesh_device_count(shape)]
  if devices is None:
    shape = resolve_mesh_shape(shape, axes, jax.device_count())
    return jax.make_mesh(shape, tuple(axes), axis_types=axis_types)
  shape = resolve_mesh_shape(shape, axes, len(devices))
  return jax.sharding.Mesh(np.asarray(devices).reshape(shape), tuple(axes), axis_types=axis_types)


def logical_to_spec(logical_axes, shape, mesh) -> P:
  """PartitionSpec for a tensor; mesh axes that are absent, reused or do not divide the dim are dropped."""
  used, spec = set(), []
  for name, dim in zip(logical_axes, shape):
    mesh_axes = []
    for ax in AXIS_RULES.get(name, ()):
      size = mesh.shape.get(ax, 1)
      if size > 1 and ax not in used and dim % (size * math.prod(mesh.shape[a] for a in mesh_axes)) == 0:
        mesh_axes.append(ax)
        used.add(ax)
    spec.append(tuple(mesh_axes) if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
  return P(*spec)


def _is_variable(x):
  return isinstance(x, nnx.Variable)


def param_shardings(abstract_params: nnx.State, mesh) -> nnx.State:
  """Each parameter's NamedSharding, from its `axes` metadata and AXIS_RULES."""
  def one(var):
    axes = var.get_metadata().get('axes') or (None,) * var.ndim
    return var.replace(NamedSharding(mesh, logical_to_spec(axes, var.shape, mesh)))
  return jax.tree.map(one, abstract_params, is_leaf=_is_variable)


def like_params_shardings(tree, abstract_params: nnx.State, param_sh: nnx.State, mesh):
  """Shardings for a tree holding per-parameter copies (Adam moments): each leaf whose key path ends
  with a parameter's path and has its shape gets that parameter's sharding; the rest are replicated.
  """
  by_path = {}
  for (path, a), sh in zip(jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(param_sh)):
    by_path[path] = (a.shape, sh)
  replicated = NamedSharding(mesh, P())

  def one(path, leaf):
    for start in range(len(path)):
      shape, sh = by_path.get(path[start:], (None, None))
      if sh is not None and shape == leaf.shape:
        return sh
    return replicated
  return jax.tree_util.tree_map_with_path(one, tree)


def batch_spec(mesh) -> P:
  """Batch rows split over every data-parallel axis of the mesh."""
  axes = tuple(a for a in AXIS_RULES['batch'] if mesh.shape.get(a, 1) > 1)
  return P(axes if axes else None)


def put_batch(local_batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
  """Global arrays from this process's rows of the batch (multi-host safe)."""
  sharding = NamedSharding(mesh, batch_spec(mesh))
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
