"""The encode flow: tokenize a dataset's sides once, then encode every (side, K, shard) of the grid (its own module:
the other stages' flows are generated in flows/stage_flows.py).

Shards already done with the same config are skipped, so a re-run resumes a killed one. Runs in-process,
on a local Dask cluster (``workers``), or on an existing one (``dask_address``; one worker per GPU).
"""

from __future__ import annotations

from prefect import flow

from diffret.stages import encode as encode_stage
from diffret.stages import tokenize as tokenize_stage
from diffret.stages.encode import EncodeConfig

from .compose import run_encode
from .runner import run_in_flow, run_name

__all__ = ["EncodeConfig", "encode_flow", "run_encode"]


@flow(name="encode", flow_run_name=run_name, description=encode_stage.stage.description)
def encode_flow(config: EncodeConfig) -> dict:
    run_in_flow(tokenize_stage.stage, config.tokenize_config())
    return run_in_flow(encode_stage.stage, config)
