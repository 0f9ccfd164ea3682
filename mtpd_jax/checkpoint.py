"""The one orbax seam: the train state and the grain iterator, saved together, atomically.

Orbax writes each step into a temporary directory and renames it when complete, so a kill
mid-save leaves the previous checkpoint intact; `max_to_keep` only prunes after a newer one
has been finalised.
"""

import os

import grain
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves {state, data iterator} every `every_steps` (and on demand); restores the latest."""

  def __init__(self, directory: str, *, every_steps: int, max_to_keep: int):
    self.every_steps = every_steps
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=False)
    self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                         item_names=('state', 'data'))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def should_save(self, step: int) -> bool:
    return self.every_steps > 0 and step % self.every_steps == 0

  def save(self, step: int, state, iterator=None) -> None:
    items = {'state': ocp.args.StandardSave(state)}
    if iterator is not None:
      items['data'] = grain.checkpoint.CheckpointSave(iterator)
    self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, abstract_state, iterator=None):
    """The state at `step` (placed per the shardings in `abstract_state`); `iterator` is rewound in place."""
    items = {'state': ocp.args.StandardRestore(abstract_state)}
    if iterator is not None:
      items['data'] = grain.checkpoint.CheckpointRestore(iterator)
    return self.manager.restore(step, args=ocp.args.Composite(**items))['state']

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
