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

Every name is importable from ``retrieval.models.backbones`` as before the split. A test that patches a module
global (``VOCAB_BLOCK_BYTES``) patches the module that reads it (``backbones.backbone``).
"""

from .adapters import ADAPTER_CONFIG, BASE_FILE, with_adapter
from .adapters import _apply_adapter as _apply_adapter
from .adapters import _remapped_adapter as _remapped_adapter
from .adapters import _same_model as _same_model
from .backbone import VOCAB_BLOCK_BYTES, Backbone, bidirectional_mask, softmax_stats
from .backbone import _find_projection as _find_projection
from .backbone import _is_causal_arch as _is_causal_arch
from .backbone import _llada_head as _llada_head
from .backbone import _llada_trunk as _llada_trunk
from .backbone import _pad_id as _pad_id
from .backbone import _split_head as _split_head
from .config import BackboneConfig, canonical_model
from .errors import BackboneError
from .errors import _load_error as _load_error
from .errors import _unreachable as _unreachable
from .families import _LLADA_KEYS as _LLADA_KEYS
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
from .families import _llama_config as _llama_config
from .families import _qwen2_config as _qwen2_config
from .files import _SAMPLE_BYTES as _SAMPLE_BYTES
from .files import _SAMPLES as _SAMPLES
from .files import _SAVED_STORES as _SAVED_STORES
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
from .files import _check_safetensors as _check_safetensors
from .files import _check_tokenizer_files as _check_tokenizer_files
from .files import _fingerprint as _fingerprint
from .loading import _model_ref as _model_ref
from .loading import _version as _version
from .loading import check_tokenizer, check_weights, load_backbone, load_tokenizer, raw_config, resolve_family

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
    "bidirectional_mask",
    "canonical_model",
    "check_model_files",
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
