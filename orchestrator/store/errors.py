"""What the store raises: requests it cannot honour, each with a message saying why.

In their own module so every part of the Store (runs, decisions, scores, ...) raises the same
classes; `orchestrate.store.store` re-exports them for callers.
"""

from __future__ import annotations


class StoreError(Exception):
    """A request the store cannot honour; the message says why."""


class RunNotFound(StoreError, LookupError):
    pass


class AmbiguousRun(StoreError, LookupError):
    pass


class DuplicateRun(StoreError):
    pass


class ResumeClaimed(DuplicateRun):
    """Another `run --resume` of the same run began first; the message names its run, pid
    and host."""


class StoreUnavailable(StoreError):
    """A database, runs folder or MLflow store that cannot be used as given.

    The message is one line naming the thing and the fix; the CLI prints it as it is (exit
    2), so it must never carry a traceback, SQL or its parameters.
    """


class UnknownSchema(StoreUnavailable, RuntimeError):
    """The database was written by a newer orchestrate (a RuntimeError, as it always was)."""
