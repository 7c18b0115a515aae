"""The domain of diffret, importable without Prefect: collections, representations, scoring, evaluation."""
