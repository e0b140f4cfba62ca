"""A user's object by name: `path/to/file.py:Name` or `package.module:Name`, for `--task` and the OpenEnv server this
repository launches (tasks/openenv_launch.py)."""

import importlib
import importlib.util
import sys
from pathlib import Path

from tasks.base import TaskError


def user_module(location: str) -> object:
    """A Python file (`.py`, imported as the module user_task_<stem>) or an importable module."""
    if location.endswith(".py"):
        path = Path(location).expanduser().resolve()
        if not path.is_file():
            raise TaskError(f"task file {location!r} does not exist")
        module_name = f"user_task_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look a class's module up here
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as error:  # a script that exits on import
            raise TaskError(f"task file {location!r} does not import: {error!r}") from error
        return module
    try:
        return importlib.import_module(location)
    except (Exception, SystemExit) as error:
        raise TaskError(f"task module {location!r} does not import: {error!r}; a file needs the .py suffix, and a "
                        "registered task's name is one of those --help lists") from error


def user_class(location: str, name: str) -> object:
    """`name` from a Python file (`.py`) or an importable module: a class, or a dict of classes (environments routed by
    a row's `environment` field)."""
    module = user_module(location)
    if not hasattr(module, name):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and v.__module__ == module.__name__)
        raise TaskError(f"{location!r} has no class {name!r} (the classes it defines: {found})")
    return getattr(module, name)
