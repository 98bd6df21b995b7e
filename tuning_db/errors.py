"""The one error the store raises: it says which database and what to do about it."""


class TuningDbError(RuntimeError):
    """A database that cannot be used as asked (damaged, locked, read-only, too new, ...)."""
