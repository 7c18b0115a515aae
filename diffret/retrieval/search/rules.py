"""How scores are computed: the reference evaluator's rules by default, each deviation a named setting.

The defaults follow ``scripts/evaluate_sweep.py`` of ielab/diffretriever (the code behind the paper's tables,
commit 1689527; ``../shared/fixtures/reference-eval`` holds its outputs); each default is the reference's choice
(docs/ARCHITECTURE.md, parity table), each other value a named option:

- ``multi_dense``: each query slot's best passage-slot cosine clamped at 0, summed over the query's slots
  (L291-343). ``maxsim_clamp=False, maxsim_reduce="mean"``: no clamp, the mean over the slots.
- ``single_dense``: the mean of the L2-normalised slots, not normalised again (L670-672, L828-841).
  ``single_renorm=True``: the mean L2-normalised again.
- ``sparse_max``: the product of the integers the reference stores, round(100 w), for readouts whose weights
  are multiples of 0.01 (the mask readout's), so a score is 10^4 x sum w_q w_d and exact in float32 (L346-442).
  A run holds documents without a shared term too (score 0, in corpus order) up to its depth, and they count in
  fusion's minimum. ``sparse_scale="unit"``: the weights themselves; ``sparse_floor="positive"``: documents
  sharing a term only.
- fusion: ``(s - min) / max(max - min, 1e-9)`` of each run's top ``depth``, so a run whose scores are all
  equal contributes 0 (L449-471). ``fusion_flat="one"``: such a run contributes 1.
- ``score_dtype="bfloat16"`` rounds where the released evaluator computes in bfloat16 (slot normalisation, the
  mean vector, every dot product, the per-slot maximum, the sparse operands and products); the default is the
  float32 evaluator (the fixture's ``runs/fp32``). bfloat16 ties decide top-10 membership on close scores.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field

from ..fields import Settings

# the modes each rule changes (a run records only the rules of its mode)
_RULES_OF_MODE: dict[str, tuple[str, ...]] = {
    "single_dense": ("single_renorm", "score_dtype"),
    "multi_dense": ("maxsim_clamp", "maxsim_reduce", "score_dtype"),
    "sparse_max": ("sparse_scale", "sparse_floor", "score_dtype"),
}


class ScoreRules(Settings):
    """How each mode scores (defaults: the reference's choice, docs/ARCHITECTURE.md, parity table; see the module
    docstring).

    >>> ScoreRules().for_mode("multi_dense")
    {'maxsim_clamp': True, 'maxsim_reduce': 'sum', 'score_dtype': 'float32'}
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    maxsim_clamp: bool = Field(
        default=True,
        description="MaxSim: clamp each query slot's best passage-slot "
        "score at 0 (the reference's choice; off: unclamped).",
    )
    maxsim_reduce: Literal["sum", "mean"] = Field(
        default="sum", description="MaxSim over the query slots: sum (the reference's choice) or mean (same ranking)."
    )
    single_renorm: bool = Field(
        default=False,
        description="single_dense: L2-normalise the mean of the normalised slots again (the reference's choice: off).",
    )
    sparse_scale: Literal["x100", "unit"] = Field(
        default="x100",
        description="sparse_max: x100 scores the "
        "integers round(100 w) the reference stores (weights in steps of "
        "0.01; the reference's choice); unit: the weights.",
    )
    sparse_floor: Literal["zero", "positive"] = Field(
        default="zero",
        description="zero: a sparse run is filled to "
        "its depth with zero-score documents, which count in fusion's "
        "minimum (the reference's choice); positive: documents sharing "
        "a term only.",
    )
    fusion_flat: Literal["zero", "one"] = Field(
        default="zero",
        description="Fusion: a run whose scores for a query "
        "are all equal normalises to 0 (the reference's choice) or 1.",
    )
    score_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Score arithmetic: float32, or bfloat16 where the released evaluator rounds (its ties).",
    )

    def for_mode(self, mode: str, fuses: tuple[str, ...] = ()) -> dict[str, Any]:
        """The rules a run of ``mode`` depends on (a fusion: its inputs' and its own), for its recorded config."""
        if fuses:
            out: dict[str, Any] = {}
            for m in fuses:
                out.update(self.for_mode(m))
            return {**out, "fusion_flat": self.fusion_flat}
        return {name: getattr(self, name) for name in _RULES_OF_MODE.get(mode, ())}

    def sparse_factor(self, quantised: bool) -> float:
        """What stored sparse weights are multiplied by before scoring: 100 for weights in steps of 0.01 under
        ``x100`` (then rounded to integers), else 1.

        >>> ScoreRules().sparse_factor(True), ScoreRules(sparse_scale="unit").sparse_factor(True)
        (100.0, 1.0)
        """
        return 100.0 if (quantised and self.sparse_scale == "x100") else 1.0

    def factor_for(self, readout: str | None, readout_settings: dict | None) -> float:
        """The sparse scale for a system's stored weights, from its readout and settings: the one place the score,
        beta and late stages and the Python API (``diffret.search``) take it from.

        >>> ScoreRules().factor_for("diffretriever", {}), ScoreRules().factor_for("promptreps", {"finetuned": "no"})
        (100.0, 1.0)
        """
        from diffret.retrieval.models.readouts import sparse_quantised

        return self.sparse_factor(sparse_quantised(readout, readout_settings))

    @property
    def bf16(self) -> bool:
        return self.score_dtype == "bfloat16"


def round_bf16_(x: torch.Tensor) -> torch.Tensor:
    """Round a float32 tensor to bfloat16 precision in place (round to nearest even) and return it.

    >>> round_bf16_(torch.tensor([26895.0, 1.0])).tolist()
    [26880.0, 1.0]
    """
    return x.copy_(x.to(torch.bfloat16))
