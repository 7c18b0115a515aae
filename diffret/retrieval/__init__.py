"""The domain of diffret as pure libraries, importable without Prefect and without the store layout:
``data`` (collections), ``models`` (representations), ``search`` (scoring), ``evaluation``, ``analysis``."""
