"""The encode flow: tokenize a dataset's sides once, then encode every (side, K, shard) of the grid.

Shards already done with the same config are skipped, so a re-run resumes a killed one. Runs in-process,
on a local Dask cluster (``workers``), or on an existing one (``dask_address``; one worker per GPU).
"""

from __future__ import annotations

from collections.abc import Callable

from prefect import flow

from stages import StageResult
from stages import encode as encode_stage
from stages import tokenize as tokenize_stage
from stages.encode import EncodeConfig
from stages.tokenize import TokenizeConfig

from .runner import prefect_api, run_in_flow, run_name, run_stage

__all__ = ["EncodeConfig", "TokenizeConfig", "encode_flow", "run_encode", "tokenize_flow"]


@flow(name="tokenize", flow_run_name=run_name, description=tokenize_stage.stage.description)
def tokenize_flow(config: TokenizeConfig) -> dict:
    return run_in_flow(tokenize_stage.stage, config)


@flow(name="encode", flow_run_name=run_name, description=encode_stage.stage.description)
def encode_flow(config: EncodeConfig) -> dict:
    run_in_flow(tokenize_stage.stage, config.tokenize_config())
    return run_in_flow(encode_stage.stage, config)


def run_encode(
    config: EncodeConfig,
    *,
    prefect: bool = False,
    log: Callable[[str], None] = print,
    report: Callable | None = None,
) -> StageResult:
    """Tokenize what is missing, then encode: through Prefect (one flow run) or in this process."""
    if prefect:
        with prefect_api():
            return StageResult.model_validate(encode_flow(config))
    tok = run_stage(tokenize_stage.stage, config.tokenize_config(), log=log, report=report)
    if tok.done:
        log(f"tokenize: {tok.line()}")
    return run_stage(encode_stage.stage, config, log=log, report=report)
