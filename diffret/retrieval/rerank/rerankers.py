"""DiffuRank's four rerankers on a diffusion (or masked) LM: prompts with masked answer slots, read from
bidirectional forward passes.

- ``pointwise``: prompt(q, d) + one masked answer, one pass per pair (pairs batched across queries);
  score = p("1") / (p("0") + p("1")).
- ``logits_listwise``: N documents in one prompt, ``Doc i: [M]`` per document, one pass per window; each
  document scored as above; windows merged as RankGPT's sliding window.
- ``permutation_sampling``: N masked rank slots over identifiers, filled over S steps by low-confidence
  remasking with the feasible identifiers shrinking (always a permutation).
- ``permutation_assignment``: one pass gives the rank-slot x identifier log-probabilities; the Hungarian
  algorithm picks the permutation.

Prompts are YAML files in ``retrieval/rerank/prompts/`` rendered through the model's chat template.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import numpy as np
import torch
import yaml

from ..models.backbones import Backbone
from ..models.prompts import chat_tail, special_wrapping
from ..traits import Declared
from .algorithms import assignment_permutation, order_by_scores, permutation_decoder, window_starts, yes_no_score

_SLOT = "XSLOTX"  # a sentinel that tokenizes as ordinary text


class RerankError(ValueError):
    pass


# ------------------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class RerankPrompt:
    name: str
    system: str
    user: str  # {query} and {document} (pointwise) or {documents} and {n}
    assistant: str  # {slot} (pointwise) or {slots}
    document: str = "{text}"  # one document in {documents}: {n} (1-based), {id}, {text}
    slot: str = "{slot}"  # one answer slot in {slots}: {n}, {slot}
    slot_separator: str = " "
    answers: tuple[str, ...] = ()  # ("0", "1") for the yes / no methods
    identifiers: tuple[str, ...] = ()  # for the permutation methods


@lru_cache(maxsize=16)
def load_rerank_prompt(name: str) -> RerankPrompt:
    """A built-in prompt (``pointwise``, ``logits_listwise``, ``permutation``) or a YAML file of that form.

    >>> load_rerank_prompt("pointwise").answers
    ('0', '1')
    """
    if name.endswith((".yaml", ".yml")):
        if not Path(name).exists():
            raise RerankError(f"prompt file {name!r} does not exist")
        text = Path(name).read_text()
    else:
        folder = resources.files("diffret.retrieval.rerank") / "prompts"
        known = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
        if name not in known:
            raise RerankError(f"unknown rerank prompt {name!r}; built in: {', '.join(known)}")
        text = (folder / f"{name}.yaml").read_text()
    data = yaml.safe_load(text)
    try:
        return RerankPrompt(
            name=data.get("name", name),
            system=data.get("system", "") or "",
            user=data["user"],
            assistant=data["assistant"],
            document=data.get("document", "{text}"),
            slot=data.get("slot", "{slot}"),
            slot_separator=data.get("slot_separator", " "),
            answers=tuple(str(a) for a in data.get("answers", [])),
            identifiers=tuple(str(a) for a in data.get("identifiers", [])),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise RerankError(f"rerank prompt {name!r}: missing field {exc}") from None


@dataclass
class Encoded:
    ids: list[int]
    slots: list[int]  # positions of the masked slots


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False, verbose=False)["input_ids"]) if text else []


class PromptBuilder:
    """Token ids of a rerank prompt for one backbone: the chat template (or the tokenizer's special tokens),
    documents cut to ``doc_tokens`` tokens, one mask per answer slot, the reference's tail (closing tokens)."""

    def __init__(self, backbone: Backbone, prompt: RerankPrompt, doc_tokens: int = 128):
        self.bb, self.p, self.doc_tokens = backbone, prompt, doc_tokens
        self.tok = backbone.tokenizer
        self.mask_id = backbone.mask_id
        self.chat = backbone.has_chat_template
        eos = self.tok.eos_token_id
        self.head: list[int]
        self.tail: list[int]
        if self.chat:
            self.head, self.tail = [], chat_tail(self.tok, backbone.turn_end_id, eos)
        else:
            self.head, self.tail = special_wrapping(self.tok)
        cfg = backbone.model.config
        self.context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "max_sequence_length", None)
        self.strip_before_slot = False

    def cut(self, text: str) -> str:
        ids = _ids(self.tok, text)
        return text if len(ids) <= self.doc_tokens else self.tok.decode(ids[: self.doc_tokens])

    def token_of(self, words: Sequence[str], slot_text: str) -> list[int]:
        """The id each of ``words`` takes at a slot whose text before it is ``slot_text``'s prefix; each must be
        one token there (else RerankError). When the tokenizer merges a space into the word (GPT-2-style BPE:
        " 1" is one token), the mask stands for that token and the space before each slot is left out."""
        before = slot_text.split(_SLOT, 1)[0]
        tries = [(before, "")]
        if before != before.rstrip():
            tries.append((before.rstrip(), before[len(before.rstrip()) :]))
        for prefix, space in tries:
            base = _ids(self.tok, prefix)
            out = []
            for w in words:
                full = _ids(self.tok, prefix + space + w)
                if full[: len(base)] != base or len(full) != len(base) + 1:
                    break
                out.append(full[-1])
            else:
                if len(set(out)) != len(out):
                    raise RerankError(f"answers / identifiers {list(words)} share tokens in {self.bb.name}'s tokenizer")
                self.strip_before_slot = bool(space)
                return out
        pieces = self.tok.convert_ids_to_tokens(_ids(self.tok, w))
        raise RerankError(
            f"{w!r} is not a single token after {before!r} in {self.bb.name}'s tokenizer "
            f"({pieces}); choose single-token answers / identifiers in the prompt"
        )

    def encode(self, user: str, assistant: str) -> Encoded:
        if self.chat:
            messages = [{"role": "system", "content": self.p.system}] if self.p.system else []
            messages.append({"role": "user", "content": user})
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + assistant
            ids: list[int] = []
        else:
            text = (self.p.system + "\n" if self.p.system else "") + user + "\n" + assistant
            ids = list(self.head)
        slots = []
        pieces = text.split(_SLOT)
        for i, piece in enumerate(pieces):
            if i < len(pieces) - 1 and self.strip_before_slot:
                piece = piece.rstrip(" ")  # the slot's token carries the space (see token_of)
            ids += _ids(self.tok, piece)
            if i < len(pieces) - 1:
                slots.append(len(ids))
                ids.append(self.mask_id)
        ids += self.tail
        if self.context and len(ids) > self.context:
            raise RerankError(
                f"a prompt of {len(ids)} tokens exceeds {self.bb.name}'s context of {self.context}; "
                "use a smaller --window or --doc-tokens"
            )
        return Encoded(ids, slots)

    def pointwise(self, query: str, doc: str) -> Encoded:
        user = self.p.user.format(query=query, document=self.cut(doc))
        return self.encode(user, self.p.assistant.format(slot=_SLOT))

    def listwise(self, query: str, docs: Sequence[str], ids: Sequence[str] = ()) -> Encoded:
        n = len(docs)
        idents = list(ids) or [str(i + 1) for i in range(n)]
        documents = "\n".join(
            self.p.document.format(n=i + 1, id=idents[i], text=self.cut(d)) for i, d in enumerate(docs)
        )
        user = self.p.user.format(query=query, documents=documents, n=n)
        slots = self.p.slot_separator.join(self.p.slot.format(n=i + 1, slot=_SLOT) for i in range(n))
        return self.encode(user, self.p.assistant.format(slots=slots))


# ------------------------------------------------------------------------------------------- the forward
def _pad_right(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        att[i, : len(r)] = 1
    return ids.to(device), att.to(device)


def position_logits(bb: Backbone, rows: list[list[int]], positions: list[list[int]]) -> torch.Tensor:
    """One bidirectional pass over ``rows`` (padded together; differentiable): the full-vocabulary logits at each
    row's ``positions``, stacked row by row into ``[sum of positions, vocabulary]`` (the LM head applied at those
    positions only). The forward of both reranking and reranker training."""
    ids, att = _pad_right(rows, bb.pad_id, bb.device)
    hidden = bb.hidden_states(ids, att, bidirectional=True)
    b_idx = torch.cat([torch.full((len(p),), i, dtype=torch.long) for i, p in enumerate(positions)])
    s_idx = torch.cat([torch.as_tensor(p, dtype=torch.long) for p in positions])
    return bb.logits(hidden[b_idx.to(bb.device), s_idx.to(bb.device)])


@torch.no_grad()
def slot_logits(bb: Backbone, rows: list[Encoded], columns: Sequence[int]) -> list[np.ndarray]:
    """One bidirectional pass over ``rows`` (padded together): per row, the ``[slots, len(columns)]``
    log-probabilities at its masked slots, of the vocabulary ``columns`` (the LM head applied at the slots)."""
    logits = position_logits(bb, [r.ids for r in rows], [r.slots for r in rows]).float()
    lsm = torch.log_softmax(logits, dim=-1)[:, torch.as_tensor(list(columns), device=bb.device)]
    out, at = [], 0
    for r in rows:
        out.append(lsm[at : at + len(r.slots)].cpu().numpy().astype(np.float64))
        at += len(r.slots)
    return out


# ------------------------------------------------------------------------------------------- rerankers
@dataclass
class RerankStats:
    windows: int = 0
    forward_passes: int = 0
    invalid_without_constraint: int = 0  # permutation_sampling: outputs the constraint repaired
    extra: dict[str, Any] = field(default_factory=dict)


class Reranker(Declared):
    """Reorders each query's candidates (best first). ``rerank`` takes [(query text, [(doc id, text), ...])].

    A subclass per method declares its name and default prompt as class keywords; ``RERANKERS`` maps names to
    subclasses."""

    name: ClassVar[str]
    prompt_name: ClassVar[str]

    def __init__(
        self,
        backbone: Backbone,
        prompt: str | None = None,
        doc_tokens: int = 128,
        window: int = 20,
        step: int = 10,
        batch_size: int = 8,
        steps: int = 4,
    ):
        if window < 1 or step < 1 or batch_size < 1 or steps < 1:
            raise RerankError("window, step, batch size and steps must be positive")
        self.bb = backbone
        self.builder = PromptBuilder(backbone, load_rerank_prompt(prompt or self.prompt_name), doc_tokens)
        self.window, self.step, self.batch_size, self.steps = window, step, batch_size, steps
        self.stats = RerankStats()
        self.setup()
        self.check_context()

    def check_context(self) -> None:
        """Refuse, before any work, settings whose longest prompt (every document at ``doc_tokens`` tokens) does
        not fit the model's context (:meth:`PromptBuilder.encode` raises)."""
        self.longest_prompt(" ".join(["a"] * self.builder.doc_tokens * 2))  # each cut to doc_tokens

    def longest_prompt(self, doc: str) -> Encoded:
        raise NotImplementedError

    def setup(self) -> None:
        """Check the prompt's answer / identifier tokens against the tokenizer (fails clearly)."""

    def rerank(
        self, items: list[tuple[str, list[tuple[str, str]]]], progress: Callable[[int], None] | None = None
    ) -> list[list[tuple[str, float]]]:
        raise NotImplementedError


def _ranked(order: list[int], docs: list[tuple[str, str]]) -> list[tuple[str, float]]:
    """(doc id, score) best first; the score is the reversed rank (a run keeps the order)."""
    n = len(order)
    return [(docs[i][0], float(n - r)) for r, i in enumerate(order)]


class Pointwise(Reranker, name="pointwise", prompt_name="pointwise"):
    def setup(self) -> None:
        self.cols = self.builder.token_of(self.builder.p.answers, self.builder.p.assistant.format(slot=_SLOT))

    def longest_prompt(self, doc: str) -> Encoded:
        return self.builder.pointwise("a query", doc)

    def rerank(self, items, progress=None):
        pairs = [(qi, j) for qi, (_, docs) in enumerate(items) for j in range(len(docs))]
        scores = [np.zeros(len(d)) for _, d in items]
        for s in range(0, len(pairs), self.batch_size):
            chunk = pairs[s : s + self.batch_size]
            rows = [self.builder.pointwise(items[qi][0], items[qi][1][j][1]) for qi, j in chunk]
            for (qi, j), lg in zip(chunk, slot_logits(self.bb, rows, self.cols), strict=True):
                scores[qi][j] = float(yes_no_score(lg[0, 0], lg[0, 1]))
            self.stats.forward_passes += 1
            if progress:  # queries whose last pair was in this batch
                progress(sum(1 for qi, j in chunk if j == len(items[qi][1]) - 1))
        out = []
        for (_, docs), sc in zip(items, scores, strict=True):
            order = order_by_scores(sc.tolist())
            out.append([(docs[i][0], float(sc[i])) for i in order])
        return out


class _Windowed(Reranker):
    """Listwise methods: RankGPT's sliding window; the k-th window of every query in one batch."""

    def rank_windows(self, windows: list[tuple[str, list[str]]]) -> list[list[int]]:
        raise NotImplementedError

    def window_ids(self, n: int) -> list[str]:
        """The identifiers of a window of ``n`` documents in the prompt (default: Doc 1 .. Doc n)."""
        return []

    def longest_prompt(self, doc: str) -> Encoded:
        return self.builder.listwise("a query", [doc] * self.window, self.window_ids(self.window))

    def rerank(self, items, progress=None):
        orders = [list(range(len(docs))) for _, docs in items]
        plans = [window_starts(len(docs), self.window, self.step) for _, docs in items]
        for w in range(max((len(p) for p in plans), default=0)):
            live = [qi for qi, p in enumerate(plans) if w < len(p)]
            for s in range(0, len(live), self.batch_size):
                batch = live[s : s + self.batch_size]
                windows = []
                for qi in batch:
                    a, b = plans[qi][w]
                    windows.append((items[qi][0], [items[qi][1][i][1] for i in orders[qi][a:b]]))
                for qi, perm in zip(batch, self.rank_windows(windows), strict=True):
                    a, b = plans[qi][w]
                    seg = orders[qi][a:b]
                    if sorted(perm) != list(range(len(seg))):
                        raise RerankError(f"{self.name}: a window's ranking is not a permutation: {perm}")
                    orders[qi][a:b] = [seg[i] for i in perm]
                self.stats.windows += len(batch)
            if progress:
                progress(sum(1 for qi in live if w == len(plans[qi]) - 1))
        return [_ranked(o, docs) for o, (_, docs) in zip(orders, items, strict=True)]


class LogitsListwise(_Windowed, name="logits_listwise", prompt_name="logits_listwise"):
    def setup(self) -> None:
        first_slot = self.builder.p.slot.format(n=1, slot=_SLOT)
        self.cols = self.builder.token_of(self.builder.p.answers, first_slot)

    def rank_windows(self, windows):
        rows = [self.builder.listwise(q, docs) for q, docs in windows]
        self.stats.forward_passes += 1
        logits = slot_logits(self.bb, rows, self.cols)
        return [order_by_scores(yes_no_score(lg[:, 0], lg[:, 1]).tolist()) for lg in logits]


class _Permutation(_Windowed, prompt_name="permutation"):
    def setup(self) -> None:
        idents = self.builder.p.identifiers
        if self.window > len(idents):
            raise RerankError(f"a window of {self.window} needs as many identifiers; the prompt has {len(idents)}")
        self.idents = list(idents[: self.window])
        self.cols = self.builder.token_of(self.idents, self.builder.p.slot.format(n=1, slot=_SLOT))

    def window_ids(self, n: int) -> list[str]:
        return self.idents[:n]

    def rows(self, windows: list[tuple[str, list[str]]]) -> list[Encoded]:
        return [self.builder.listwise(q, docs, self.window_ids(len(docs))) for q, docs in windows]


class PermutationAssignment(_Permutation, name="permutation_assignment"):
    def rank_windows(self, windows):
        self.stats.forward_passes += 1
        out = []
        for (_, docs), lg in zip(windows, slot_logits(self.bb, self.rows(windows), self.cols), strict=True):
            out.append(assignment_permutation(lg[:, : len(docs)]))
        return out


class PermutationSampling(_Permutation, name="permutation_sampling"):
    """Every window of the batch decodes in lockstep, its constrained and its unconstrained decoding (the latter
    only counts the outputs the constraint repaired): one batched forward pass per denoising step."""

    def rank_windows(self, windows: list[tuple[str, list[str]]]) -> list[list[int]]:
        rows = self.rows(windows)
        # (window, constrained, decoder, its state before the next step)
        live: list[tuple[int, bool, Generator[list[int | None], np.ndarray, list[int | None]], list[int | None]]] = []
        for w, (_, docs) in enumerate(windows):
            for constrained in (True, False):
                decoder = permutation_decoder(len(docs), self.steps, constrained)
                live.append((w, constrained, decoder, next(decoder)))
        done: dict[tuple[int, bool], list[int | None]] = {}
        while live:
            filled = []
            for w, _, _, state in live:
                ids = list(rows[w].ids)
                for slot, ident in zip(rows[w].slots, state, strict=True):
                    if ident is not None:
                        ids[slot] = self.cols[ident]
                filled.append(Encoded(ids, rows[w].slots))
            self.stats.forward_passes += 1
            still = []
            for (w, constrained, decoder, _), lg in zip(live, slot_logits(self.bb, filled, self.cols), strict=True):
                n = len(windows[w][1])
                try:
                    still.append((w, constrained, decoder, decoder.send(lg[:, :n])))
                except StopIteration as end:
                    done[(w, constrained)] = end.value
            live = still
        out = []
        for w, (_, docs) in enumerate(windows):
            free = [x for x in done[(w, False)] if x is not None]  # a finished decoding has filled every slot
            self.stats.invalid_without_constraint += int(sorted(free) != list(range(len(docs))))
            out.append([int(x) for x in done[(w, True)] if x is not None])
        return out


RERANKERS: dict[str, type[Reranker]] = {
    cls.name: cls for cls in (Pointwise, LogitsListwise, PermutationSampling, PermutationAssignment)
}
RerankerName = Literal["pointwise", "logits_listwise", "permutation_sampling", "permutation_assignment"]
assert set(get_args(RerankerName)) == set(RERANKERS)  # the config's choices are the registry's


def batch_cuts(method: str, sizes: Sequence[int], batch_size: int, window: int = 20, step: int = 10) -> list[int]:
    """Where a list of queries (``sizes``: each one's candidates) can be cut so that every part is batched exactly as
    the whole list is (each forward pass sees the same rows, so the parts give the whole list's scores bit for bit):
    the positions ``0 < i < len(sizes)`` where each batch of the whole starts anew. Pointwise batches pairs across
    queries; the listwise methods batch the live queries of each window step.

    >>> batch_cuts("pointwise", [3, 3, 2, 4, 4], batch_size=4)   # pairs before: 3, 6, 8, 12
    [3, 4]
    >>> batch_cuts("logits_listwise", [5, 5, 5, 5], batch_size=2, window=3, step=1)
    [2]
    """
    n = len(sizes)
    if method == "pointwise":
        before = np.cumsum(sizes)[:-1] if n else np.zeros(0, np.int64)
        return [i + 1 for i, b in enumerate(before.tolist()) if b % batch_size == 0]
    windows = np.array([len(window_starts(s, window, step)) for s in sizes], np.int64)
    ok = np.ones(max(n - 1, 0), bool)
    for w in range(int(windows.max()) if n else 0):
        live_before = np.cumsum(windows > w)[:-1]  # the queries before each cut that take part in window step w
        ok &= live_before % batch_size == 0
    return [i + 1 for i in np.flatnonzero(ok).tolist()]


def make_reranker(name: str, backbone: Backbone, **kw: Any) -> Reranker:
    """A registered reranker by name.

    >>> list(RERANKERS)
    ['pointwise', 'logits_listwise', 'permutation_sampling', 'permutation_assignment']
    """
    if name not in RERANKERS:
        raise RerankError(f"unknown reranker {name!r}; expected one of {', '.join(RERANKERS)}")
    return RERANKERS[name](backbone, **kw)
