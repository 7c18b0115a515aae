"""Prefect flows, one per pipeline stage, and the ``diffret`` command line."""
