"""Prefect tasks: thin units of work (retries, tags, caching) around retrieval/ and storage/."""
