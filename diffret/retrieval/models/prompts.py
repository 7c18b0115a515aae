"""Prompts (YAML files in ``retrieval/models/prompts/``) and their token pieces around a text.

A text is tokenized once per (tokenizer, side) and stored; at encode time its ids are wrapped as

    prefix + text + suffix [+ K masks + tail]

as the reference encoder (ielab/diffretriever) builds them: the chat template is rendered around a sentinel
with the prompt's system message and the user turn ``user_prefix + text + user_suffix``; the suffix runs
through the assistant prefix (``The words are: "``); the tail after the masks is the closing quote, the end
of turn and EOS (three tokens). A prompt written for one word is adapted to K > 1 ("four words ... The words
are"), as the reference does. Models without a chat template get the plain text in their own special tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

_SENTINEL = "XSENTINELX"  # the reference's sentinel: it tokenizes like ordinary text, never as a special token
SIDES = ("query", "passage")
_NUM_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
N_TAIL = 3  # tokens after the masks: the closing quote, the end of turn, EOS (padded with EOS)


class PromptError(ValueError):
    pass


@dataclass(frozen=True)
class PromptTemplate:
    variant: str
    system: str  # "" for none
    user: dict[str, tuple[str, str]]  # side -> (user_prefix, user_suffix) around the text
    assistant_prefix: str
    chat: bool = True  # False: the prompt's ``template: none`` (plain text even for chat models)


def available_variants() -> list[str]:
    folder = resources.files("diffret.retrieval.models") / "prompts"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def default_variant(k: int) -> str:
    """The paper's default (and the reference parity fixtures'): "one word" at K = 1, "a few words" at K > 1.

    >>> default_variant(1), default_variant(4)
    ('one_word', 'few_words')
    """
    return "one_word" if k == 1 else "few_words"


@lru_cache(maxsize=32)
def load_prompt(variant: str) -> PromptTemplate:
    """A built-in variant by name (``available_variants()``) or a path to a YAML file of the same form.

    >>> load_prompt("few_words").assistant_prefix
    'The words are: "'
    """
    if variant.endswith((".yaml", ".yml")):
        path = Path(variant)
        if not path.exists():
            raise PromptError(f"prompt file {variant!r} does not exist")
        text = path.read_text()
    else:
        if variant not in available_variants():
            raise PromptError(f"unknown prompt variant {variant!r}; built in: {', '.join(available_variants())}")
        text = (resources.files("diffret.retrieval.models") / "prompts" / f"{variant}.yaml").read_text()
    data = yaml.safe_load(text)
    try:
        user = {side: (data[side].get("user_prefix", ""), data[side].get("user_suffix", "")) for side in SIDES}
        return PromptTemplate(
            data.get("variant", variant),
            data.get("system", "") or "",
            user,
            data["assistant_prefix"],
            chat=data.get("template", "chat") != "none",
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise PromptError(f"prompt {variant!r}: missing field {exc} (see retrieval/models/prompts/*.yaml)") from None


def adapt_to_k(text: str, k: int) -> str:
    """A prompt written for one word, rewritten for K words (the reference's ``_adapt_prompt_for_k``).

    >>> adapt_to_k('". Use one word to represent the query.', 4)
    '". Use four words to represent the query.'
    >>> adapt_to_k('The word is: "', 16), adapt_to_k('a few words', 8)
    ('The words are: "', 'a few words')
    """
    if k <= 1 or not text:
        return text
    count = _NUM_WORDS[k - 1] if k <= len(_NUM_WORDS) else str(k)
    text = re.sub(r"\b(?:" + "|".join(_NUM_WORDS) + r")\b(\s+words?)", f"{count} words", text)
    return re.sub(r"\bword is\b", "words are", text)


@dataclass(frozen=True)
class PromptPieces:
    prefix: tuple[int, ...]  # before the text
    suffix: tuple[int, ...]  # after the text, through the assistant prefix
    closing: tuple[int, ...]  # after the masks: closing quote, end of turn, EOS


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def build_pieces(
    tokenizer: Any, template: PromptTemplate, side: str, k: int, turn_end_id: int | None, use_chat_template: bool
) -> PromptPieces:
    """The token ids around a text for one side and budget K.

    Parameters
    ----------
    tokenizer : the model's tokenizer.
    template : a loaded prompt.
    side : ``query`` or ``passage``.
    k : the budget (the prompt's number words follow it).
    turn_end_id : the end-of-turn token of a chat model (or None).
    use_chat_template : render the chat template (else plain text in the tokenizer's special tokens).

    Examples
    --------
    >>> from tokenizers import Tokenizer, models, pre_tokenizers, processors
    >>> from transformers import PreTrainedTokenizerFast
    >>> words = "[UNK] [CLS] [SEP] Query : \\" \\". . Use one four word words to represent the query in a" \\
    ...     " retrieval task Make sure your is are lowercase The".split()
    >>> tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    >>> tk.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1),
    ...                                                                                            ("[SEP]", 2)])
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=tk, cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]")
    >>> p = build_pieces(tok, load_prompt("one_word"), "query", 4, None, use_chat_template=False)
    >>> tok.convert_ids_to_tokens(list(p.prefix)), tok.convert_ids_to_tokens(list(p.closing))
    (['[CLS]', 'Query', ':', '"'], ['"', '[SEP]'])
    >>> for part in tok.decode(list(p.suffix)).split(" . "):
    ...     print(part)
    ". Use four words to represent the query in a retrieval task
    Make sure your words are in lowercase
    The words are : "
    """
    if side not in SIDES:
        raise PromptError(f"unknown side {side!r}; expected query or passage")
    user_prefix, user_suffix = template.user[side]
    user_suffix, assistant_prefix = adapt_to_k(user_suffix, k), adapt_to_k(template.assistant_prefix, k)
    eos = tokenizer.eos_token_id
    if use_chat_template and template.chat:
        messages = [{"role": "system", "content": template.system}] if template.system else []
        messages.append({"role": "user", "content": user_prefix + _SENTINEL + user_suffix})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if _SENTINEL not in rendered:
            raise PromptError("the chat template dropped the user message")
        before, after = rendered.split(_SENTINEL, 1)
        prefix, suffix = _ids(tokenizer, before), _ids(tokenizer, after + assistant_prefix)
        closing = chat_tail(tokenizer, turn_end_id, eos)
    else:  # plain text, wrapped in the tokenizer's own special tokens (e.g. [CLS] ... [SEP])
        head, tail = special_wrapping(tokenizer)
        prefix = head + _ids(tokenizer, user_prefix)
        suffix = _ids(tokenizer, user_suffix + "\n" + assistant_prefix)
        closing = _ids(tokenizer, '"') + tail
    return PromptPieces(tuple(prefix), tuple(suffix), tuple(closing))


def chat_tail(tokenizer: Any, turn_end_id: int | None, eos: int | None) -> list[int]:
    """The reference's tail: the closing quote (when it is one token), the end of turn (unless it is EOS), then
    EOS up to N_TAIL tokens."""
    quote = _ids(tokenizer, '"')
    tail = quote[:1] if len(quote) == 1 else []
    if turn_end_id is not None and turn_end_id != eos:
        tail.append(turn_end_id)
    if eos is not None:
        tail += [eos] * (N_TAIL - len(tail))
    return tail[:N_TAIL]


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
