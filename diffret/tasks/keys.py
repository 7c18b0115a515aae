"""Names that Prefect accepts for artifact keys."""

import re


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow only lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
