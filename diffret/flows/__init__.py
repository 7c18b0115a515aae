"""Prefect flows, one per pipeline stage, and the ``diffret`` command line."""

from . import repairs as _repairs  # noqa: F401  (the store's repairs named as diffret commands)
