"""Known faults: what a user can get wrong, and the one line that says so.

A command that meets something it cannot work with — a store that is not a store, a path that is
a folder, a window that holds no records — raises a :class:`Fault` whose message names the thing
and what to do. The console script (:func:`specshadow.main.main`) is the one place that turns a
fault into that line on stderr and its exit status, for every subcommand alike; no traceback.

- :class:`BadInput` (exit status 2): a bad argument or setting — a store file that is corrupt, a
  folder given as a file, a path that does not exist, a URL that cannot be used.
- :class:`NothingToDo` (exit status 1): the input is valid but holds nothing to work on — a store
  or a window with 0 records.

Packages raise their own subclasses (``records.stores.StoreURLError``,
``records.readback.SourceError``, ``records.sqlite_store.StoreFileError``, …), so callers that
catch those keep working.
"""

from __future__ import annotations

__all__ = ["BadInput", "Fault", "NothingToDo"]


class Fault(Exception):
    """A fault the user can fix; ``str(fault)`` is the one line they see, ``status`` the exit
    status the command ends with."""

    status: int = 1


class BadInput(Fault):
    """A bad argument or setting (a store, a path, a URL): exit status 2."""

    status = 2


class NothingToDo(Fault):
    """Valid input holding nothing to work on (0 records in a store or a window): exit 1."""

    status = 1
