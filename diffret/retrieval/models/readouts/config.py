"""``ReadoutConfig``: the readout and its settings (the reference encoder's defaults, every deviation named)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...fields import Settings

ReadoutName = Literal["diffretriever", "promptreps", "diffembed", "repllama", "sidr"]
ContentFilter = Literal["nltk", "regex", "none"]  # the sparse readouts' content-word filter (none: none)
SIDR_TOPK = 768  # SIDR's top-k at index and search time
SIDR_ONLY = ("sidr_head", "sidr_act")  # settings only the sidr readout reads (not in other systems' slugs)


class ReadoutConfig(Settings):
    """How a text becomes vectors: the readout and its settings.

    The defaults are the reference encoder's (ielab/diffretriever, whose code produced the paper's numbers);
    every other value is a named deviation (docs/ARCHITECTURE.md, parity table). The reference encodes a
    fine-tuned model another way than a zero-shot one (scripts/encode.py's `trained_*` path): `finetuned`
    chooses the path, and the settings left at None / `auto` take that path's value; a system's slug records
    the resolved values.
    """

    # the readouts: READOUTS; the resolved values: resolved()

    readout: ReadoutName = Field(
        default="diffretriever", description="diffretriever | promptreps | diffembed | repllama | sidr"
    )
    finetuned: Literal["auto", "yes", "no"] = Field(
        default="auto",
        description="Encode as the reference encodes a fine-tuned model (all K slots, sparse top 256 "
        "rounded; PromptReps: exactly K slots, pooled top 256); auto: a model `diffret train` saved or a reference "
        "checkpoint (retriever_config.json).",
    )
    prompt: str = Field(
        default="auto",
        description="auto (one_word at K=1, few_words at K>1; a released checkpoint's own), a "
        "variant, a YAML path, or checkpoint (a released checkpoint's prompt ids)",
    )
    chat_template: Literal["auto", "yes", "no"] = Field(
        default="auto", description="Wrap the prompt in the model's chat template (auto: when it has one)."
    )
    truncation: Literal["prompt", "text"] = Field(
        default="prompt", description="max_length counts the prompt and the text (prompt) or the text only (text)."
    )
    denoise_steps: int = Field(default=1, ge=1, description="S: forward passes for the mask readout (1 = the paper's)")
    stop_cut: bool | None = Field(
        default=None,
        description="Mask readout: drop the slots from the first special "
        "token read (default: zero-shot yes, fine-tuned no, as the reference).",
    )
    promptreps_stop: Literal["auto", "reference", "quote_in_token", "none"] = Field(
        default="auto",
        description="PromptReps: when the words end (see PromptRepsReadout; auto: reference "
        "zero-shot, none (exactly K slots) fine-tuned).",
    )
    sparse: Literal["auto", "per_position", "pooled"] = Field(
        default="auto",
        description="per_position: top-k per slot, x100 integers, max over slots; pooled: max over "
        "slots, then top-k (auto: the reference's per readout and path).",
    )
    sparse_topk: int | None = Field(
        default=None,
        ge=1,
        description="Sparse terms kept per slot (per_position) or in "
        "all (default: 128 zero-shot mask readout, else 256, as the reference).",
    )
    sparse_quantise: Literal["auto", "truncate", "round", "none"] = Field(
        default="auto",
        description="Sparse weights as x100 integers, truncated (zero-shot mask readout) or rounded "
        "(fine-tuned), or unquantised (zero-shot PromptReps); auto: the reference's.",
    )
    content_filter: ContentFilter = Field(
        default="nltk", description="Sparse: keep the text's content words (nltk: the reference's choice; or regex)."
    )
    padding_side: Literal["left", "right"] = Field(default="left", description="left | right")
    sidr_head: Literal["official", "lm"] = Field(
        default="official",
        description="SIDR: LayerNorm x input embeddings (official) or the model's own MLM head (lm, SPLADE's).",
    )
    sidr_act: Literal["elu1p", "log1p_relu"] = Field(
        default="elu1p", description="SIDR: elu(x) + 1 (SIDR's) or log(1 + ReLU(x)) (SPLADE's)."
    )
    repllama_prefix: Literal["joined", "separate"] = Field(
        default="joined",
        description="RepLLaMA: tokenize 'query: ' + text as one string (the reference's choice) or "
        "the prefix and the text apart.",
    )

    def resolved(self, finetuned: bool | None = None) -> ReadoutConfig:
        """Every ``auto`` / None setting replaced by its path's value (``finetuned``: the detected path when
        ``finetuned`` is ``auto``; None: zero-shot).

        >>> r = ReadoutConfig().resolved(finetuned=True)
        >>> (r.finetuned, r.stop_cut, r.sparse, r.sparse_topk, r.sparse_quantise)
        ('yes', False, 'per_position', 256, 'round')
        >>> r = ReadoutConfig(readout="promptreps").resolved(finetuned=False)
        >>> (r.promptreps_stop, r.sparse, r.sparse_topk, r.sparse_quantise)
        ('reference', 'per_position', 256, 'none')
        """
        ft = {"yes": True, "no": False}.get(self.finetuned, bool(finetuned))
        mask = self.readout == "diffretriever"
        if self.readout == "sidr":  # floats, the top 768 of the pooled vector (SIDR's)
            return self.model_copy(
                update={
                    "finetuned": "yes" if ft else "no",
                    "stop_cut": False,
                    "promptreps_stop": "none",
                    "sparse": "pooled",
                    "sparse_topk": SIDR_TOPK if self.sparse_topk is None else self.sparse_topk,
                    "sparse_quantise": "none",
                }
            )
        if self.sparse != "auto":
            sparse = self.sparse
        elif ft and (self.readout == "promptreps" or self.denoise_steps > 1):
            sparse = "pooled"  # encode.py L449-458: the pooled vector's top-k (trained PromptReps, S > 1)
        else:
            sparse = "per_position"
        if self.sparse_quantise != "auto":
            quantise = self.sparse_quantise
        else:
            quantise = "round" if ft else ("truncate" if mask else "none")
        return self.model_copy(
            update={
                "finetuned": "yes" if ft else "no",
                "stop_cut": (not ft) if self.stop_cut is None else self.stop_cut,
                "promptreps_stop": ("none" if ft else "reference")
                if self.promptreps_stop == "auto"
                else self.promptreps_stop,
                "sparse": sparse,
                "sparse_topk": ((128 if mask and not ft else 256) if self.sparse_topk is None else self.sparse_topk),
                "sparse_quantise": quantise,
            }
        )

    def numbers(self) -> dict:
        """The settings as a system's slug and a training's hash record them: another readout's SIDR-only
        settings left out (their slugs are what they were before the sidr readout).

        >>> "sidr_act" in ReadoutConfig().numbers(), "sidr_act" in ReadoutConfig(readout="sidr").numbers()
        (False, True)
        """
        return self.model_dump(exclude=None if self.readout == "sidr" else set(SIDR_ONLY))

    @property
    def is_resolved(self) -> bool:
        return self.finetuned != "auto" and self == self.resolved()
