"""Search (paper section 3.3): the modes table, exact search with MaxSim, fusion, runs, LanceDB ANN, BM25."""

from .encodings import Encodings, encodings_from_table, normalise, select
from .exact import SearchSettings, search_pass
from .modes import (
    BASE_MODES,
    FUSIONS,
    MODE_NAMES,
    MODES,
    Mode,
    all_modes,
    base_modes_needed,
    check_modes,
    fuse_minmax,
    fuse_runs,
    modes_for,
)
from .rules import ScoreRules
from .runs import doc_order, run_table
from .scoring import NEG, SparseQueries, TopK, Workspace, maxsim

__all__ = [
    "BASE_MODES",
    "FUSIONS",
    "MODES",
    "MODE_NAMES",
    "NEG",
    "Encodings",
    "Mode",
    "ScoreRules",
    "SearchSettings",
    "SparseQueries",
    "TopK",
    "Workspace",
    "all_modes",
    "base_modes_needed",
    "check_modes",
    "doc_order",
    "encodings_from_table",
    "fuse_minmax",
    "fuse_runs",
    "maxsim",
    "modes_for",
    "normalise",
    "run_table",
    "search_pass",
    "select",
]
