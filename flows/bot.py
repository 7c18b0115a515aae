"""The bot flow: SIDR's binary bag-of-tokens index of a dataset's passages: their tokens (tokenized first when
missing, as the encode flow does), then the index (no model)."""

from __future__ import annotations

from prefect import flow

from diffret.stages import tokenize as tokenize_stage
from diffret.stages.bot import BotConfig, stage

from .runner import run_in_flow, run_name

__all__ = ["BotConfig", "bot_flow"]


@flow(name="bot", flow_run_name=run_name, description=stage.description)
def bot_flow(config: BotConfig) -> dict:
    run_in_flow(tokenize_stage.stage, config.tokenize_config())
    return run_in_flow(stage, config)
