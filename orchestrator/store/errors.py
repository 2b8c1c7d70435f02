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
