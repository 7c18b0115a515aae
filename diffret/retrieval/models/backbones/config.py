"""Which model to load and how (:class:`BackboneConfig`), and the canonical name of a local model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from ...fields import Settings
from .families import Family


class BackboneConfig(Settings):
    """Which model to load and how."""

    model: str = Field(description="HF hub id or local folder.")
    family: Family = Field(
        default="auto", description="auto (read from the model's config.json) | mlm | dream | llada | causal"
    )
    loader: Literal["native", "remote"] = Field(
        default="native",
        description="Dream / LLaDA: native (transformers' Qwen2 / Llama classes, no remote code) "
        "or remote (the checkpoint's own code; needs --trust-remote-code and transformers 4.46-4.57).",
    )
    gguf_file: str | None = Field(default=None, description="GGUF file name inside the model folder.")
    trust_remote_code: bool = Field(default=False, description="Allow the model's own code (loader remote).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="float32 | bfloat16 | float16"
    )
    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    attn_implementation: str | None = Field(default=None, description="eager | sdpa | flash_attention_2")
    mask_token: str | None = Field(default=None, description="Override the mask token (string).")
    turn_end: str | None = Field(default=None, description="Override the end-of-turn token (string).")
    adapter: str | None = Field(
        default=None,
        description="A peft LoRA adapter folder (diffret train) applied to "
        "--model; refused when it was trained on another base model.",
    )
    merge_adapter: bool = Field(
        default=False, description="Merge the adapter into the weights once loaded (faster; float rounding differs)."
    )
    load_format: Literal["checkpoint", "random"] = Field(
        default="checkpoint",
        description="checkpoint, or random: seeded random weights built on the device, no "
        "weight file (speed checks; labelled as random everywhere).",
    )
    shape: str | None = Field(
        default=None,
        description="With --load-format random: dream-7b or llada-8b, the "
        "published configs (NAME:key=value,... changes fields); --model gives the "
        "tokenizer.",
    )

    @model_validator(mode="after")
    def _random_only(self) -> BackboneConfig:
        if self.load_format == "random":
            for flag, value in (("--adapter", self.adapter), ("--gguf-file", self.gguf_file)):
                if value:
                    raise ValueError(
                        f"--load-format random builds the network without weights: {flag} has none to "
                        "apply (leave it out, or load the checkpoint)"
                    )
            if self.loader == "remote":
                raise ValueError(
                    "--load-format random builds the network with transformers' own classes: use loader native"
                )
            if self.shape is not None:
                from .shapes import shape_config

                shape_config(self.shape)  # an unknown preset or field: refused here
        elif self.shape is not None:
            raise ValueError(f"--shape {self.shape} is a shape for random weights: add --load-format random")
        return self

    @model_serializer(mode="wrap")
    def _checkpoint_fields_only(self, handler: Any) -> Any:
        """A checkpoint's config dumps as it did before random weights existed (without ``load_format`` and
        ``shape``), so that every hash of a stored config that holds it is unchanged."""
        data = handler(self)
        if self.load_format == "checkpoint" and isinstance(data, dict):
            data.pop("load_format", None)
            data.pop("shape", None)
        return data

    @property
    def random_weights(self) -> bool:
        """Built with random weights (``load_format`` random): its numbers measure speed, not retrieval."""
        return self.load_format == "random"

    @field_validator("model", "adapter")
    @classmethod
    def _canonical_path(cls, v: str | None) -> str | None:
        """A local folder by its canonical path (absolute, symlinks resolved), however it was typed: the same
        folder is one system. Hub ids stay as they are."""
        return canonical_model(v) if v else v


def canonical_model(model: str) -> str:
    """``model`` as an absolute path with symlinks resolved when it names an existing local folder or file, else
    unchanged (a hub id).

    >>> canonical_model("org/name-on-the-hub")
    'org/name-on-the-hub'
    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     canonical_model(os.path.join(d, ".", "")) == os.path.realpath(d)
    True
    """
    path = Path(model).expanduser()
    return os.path.realpath(path) if path.exists() else model
