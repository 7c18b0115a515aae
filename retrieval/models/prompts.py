"""Prompts (YAML files in ``retrieval/prompts/``) and their token pieces around a text.

A text is tokenized once per (tokenizer, side) and stored; at encode time its ids are wrapped as

    prefix + text + suffix [+ K masks + closing]

where prefix/suffix come from the model's chat template (or plain text for models without one)
rendered around a sentinel, the suffix ends with the assistant prefix ``The words are "``, and the
closing is the closing quote, the end-of-turn token and EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

_SENTINEL = "\u2063DIFFRET_TEXT\u2063"
SIDES = ("query", "passage")


class PromptError(ValueError):
    pass


@dataclass(frozen=True)
class PromptTemplate:
    variant: str
    user: dict[str, str]  # side -> user message with {text}
    assistant_prefix: str
    closing: str


def available_variants() -> list[str]:
    folder = resources.files("retrieval.models") / "prompts"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def default_variant(k: int) -> str:
    """The paper's default: "one word" at K = 1, "a few words" at K > 1."""
    return "one_word" if k == 1 else "few_words"


@lru_cache(maxsize=32)
def load_prompt(variant: str) -> PromptTemplate:
    """A built-in variant by name (one_word, few_words, three_words) or a path to a YAML file."""
    if variant.endswith((".yaml", ".yml")):
        path = Path(variant)
        if not path.exists():
            raise PromptError(f"prompt file {variant!r} does not exist")
        text = path.read_text()
    else:
        if variant not in available_variants():
            raise PromptError(f"unknown prompt variant {variant!r}; built in: {', '.join(available_variants())}")
        text = (resources.files("retrieval.models") / "prompts" / f"{variant}.yaml").read_text()
    data = yaml.safe_load(text)
    try:
        user = {side: data[side]["user"] for side in SIDES}
        tpl = PromptTemplate(data.get("variant", variant), user, data["assistant_prefix"], data["closing"])
    except (KeyError, TypeError) as exc:
        raise PromptError(f"prompt {variant!r}: missing field {exc}") from None
    for side, msg in tpl.user.items():
        if msg.count("{text}") != 1:
            raise PromptError(f"prompt {variant!r}: the {side} message must contain {{text}} exactly once")
    return tpl


@dataclass(frozen=True)
class PromptPieces:
    prefix: tuple[int, ...]  # before the text
    suffix: tuple[int, ...]  # after the text, through the assistant prefix
    closing: tuple[int, ...]  # after the masks: closing quote, end of turn, EOS


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def build_pieces(
    tokenizer: Any, template: PromptTemplate, side: str, turn_end_id: int | None, use_chat_template: bool
) -> PromptPieces:
    if side not in SIDES:
        raise PromptError(f"unknown side {side!r}; expected query or passage")
    user = template.user[side].replace("{text}", _SENTINEL)
    eos = tokenizer.eos_token_id
    if use_chat_template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        if _SENTINEL not in rendered:
            raise PromptError("the chat template dropped the user message")
        before, after = rendered.split(_SENTINEL)
        prefix, suffix = _ids(tokenizer, before), _ids(tokenizer, after + template.assistant_prefix)
        closing = _ids(tokenizer, template.closing)
        if turn_end_id is not None:
            closing.append(turn_end_id)
        if eos is not None and eos != turn_end_id:
            closing.append(eos)
    else:  # plain text, wrapped in the tokenizer's own special tokens (e.g. [CLS] ... [SEP])
        before, after = user.split(_SENTINEL)
        head, tail = special_wrapping(tokenizer)
        prefix = head + _ids(tokenizer, before)
        suffix = _ids(tokenizer, after + "\n" + template.assistant_prefix)
        closing = _ids(tokenizer, template.closing) + tail
    return PromptPieces(tuple(prefix), tuple(suffix), tuple(closing))


def special_wrapping(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens a tokenizer puts before and after a single sequence (e.g. [CLS] / [SEP])."""
    for probe in ("hello", "a", "x"):
        bare = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
        if not bare:
            continue
        for i in range(len(full) - len(bare) + 1):
            if full[i : i + len(bare)] == bare:
                return full[:i], full[i + len(bare) :]
    return [], []
