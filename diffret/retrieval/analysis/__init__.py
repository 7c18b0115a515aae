"""Analyses (paper sections 4.4 and 6) over the SQL views: budget selection, landscapes, the per-query oracle,
feature correlation, the paper tables, the footprint; their figures, the leaderboard summary and the report."""
