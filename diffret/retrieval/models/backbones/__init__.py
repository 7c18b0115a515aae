"""Backbones: a loaded model + tokenizer with what the readouts need to know about its family.

Families (``family`` in the config; ``auto`` picks one from the model's config.json):
- ``mlm``: any ``AutoModelForMaskedLM`` (BERT, ModernBERT, small diffusion chat models); bidirectional.
- ``dream``: Dream-org/Dream-v0-Instruct-7B (mask ``<|mask|>``, turn end ``<|im_end|>``).
- ``llada``: GSAI-ML/LLaDA-8B-Instruct, LLaDA-1.5 (mask id 126336, turn end ``<|eot_id|>``).
- ``causal``: any ``AutoModelForCausalLM`` (PromptReps, RepLLaMA; also a causal architecture read
  bidirectionally, through a full 4D attention mask, for DiffEmbed / mask readouts).

Dream and LLaDA ship their own model code. By default (``loader="native"``) they load through transformers'
own classes instead: Dream is a Qwen2 network and LLaDA a Llama network (its weights renamed on load), read
with a bidirectional 4D attention mask. That needs no remote code, works on current transformers and honours
padding. ``loader="remote"`` runs the checkpoint's own code (``trust_remote_code``; transformers 4.46-4.57).

The LM head is split from the trunk so that logits are computed only where they are needed
(the K mask positions), never over the whole sequence (a 152k vocabulary over every position
costs ~600 MB per batch).

The package's modules, each importing only those above it:

- ``errors``: :class:`BackboneError` and the one-paragraph load error.
- ``families``: the families (:data:`FAMILIES`), their native configs and weight names, detection, mask tokens.
- ``config``: :class:`BackboneConfig`, which model to load and how.
- ``backbone``: the :class:`Backbone` (trunk, LM head read at selected positions, a block at a time on a CPU).
- ``adapters``: peft adapters (an adapter folder resolved to its base, injected or merged, remapped names).
- ``files``: a model folder's checks (weights, shards, tokenizer files, a saved model's manifest), fingerprints.
- ``loading``: :func:`load_backbone`, :func:`load_tokenizer`, the family resolved against the loader.

Every public name is importable from ``retrieval.models.backbones``; a private helper from the module that
defines it. A test that patches a module global (``VOCAB_BLOCK_BYTES``) patches the module that reads it
(``backbones.backbone``).
"""

from .adapters import ADAPTER_CONFIG, BASE_FILE, with_adapter
from .backbone import VOCAB_BLOCK_BYTES, Backbone, bidirectional_mask, softmax_stats
from .config import BackboneConfig, canonical_model
from .errors import BackboneError
from .families import (
    BERT_TARGETS,
    FAMILIES,
    QWEN2_TARGETS,
    TURN_END_CANDIDATES,
    Family,
    FamilySpec,
    NativeLoader,
    detect_family,
    mask_token_id,
)
from .files import (
    PASSAGE_ENCODER,
    TOKENIZER_FILES,
    WEIGHT_INDEXES,
    WEIGHT_SUFFIXES,
    check_model_files,
    check_saved_model,
    passage_encoder_dir,
    weights_fingerprint,
)
from .loading import (
    NotEnoughMemory,
    check_random_memory,
    check_tokenizer,
    check_weights,
    load_backbone,
    load_tokenizer,
    raw_config,
    resolve_family,
)

__all__ = [
    "ADAPTER_CONFIG",
    "BASE_FILE",
    "BERT_TARGETS",
    "FAMILIES",
    "PASSAGE_ENCODER",
    "QWEN2_TARGETS",
    "TOKENIZER_FILES",
    "TURN_END_CANDIDATES",
    "VOCAB_BLOCK_BYTES",
    "WEIGHT_INDEXES",
    "WEIGHT_SUFFIXES",
    "Backbone",
    "BackboneConfig",
    "BackboneError",
    "Family",
    "FamilySpec",
    "NativeLoader",
    "NotEnoughMemory",
    "bidirectional_mask",
    "canonical_model",
    "check_model_files",
    "check_random_memory",
    "check_saved_model",
    "check_tokenizer",
    "check_weights",
    "detect_family",
    "load_backbone",
    "load_tokenizer",
    "mask_token_id",
    "passage_encoder_dir",
    "raw_config",
    "resolve_family",
    "softmax_stats",
    "weights_fingerprint",
    "with_adapter",
]
