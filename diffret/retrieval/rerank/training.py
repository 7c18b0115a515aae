"""Training DiffuRank's rerankers on ranked lists (a query and its candidates, best first).

- ``pointwise`` and ``logits_listwise`` are trained on their answer slots' scores s = log p("1") - log p("0")
  (the log-odds of p1 / (p0 + p1), what reranking orders by) with a listwise cross-entropy (softmax over the
  list against the labels, or against the teacher's first document when the list has no labels) or RankNet
  (logistic loss over every pair the teacher orders: label_i > label_j, or rank i before rank j);
- ``permutation_sampling`` and ``permutation_assignment`` are trained by MDLM SFT on the permutation answer:
  the documents are shown in a shuffled order under their identifiers, the answer's rank slots hold the
  teacher order's identifiers, a ratio t ~ U(0, 1] of them is masked (``docid`` masking: identifier slots only;
  ``random``: any answer token, separators and closing tokens included, the ablation) and the masked tokens'
  cross-entropy is weighted by 1 / t and divided by the answer's length (LLaDA's SFT objective).

The listwise methods see each list in a shuffled order (seeded by the step and the query), so that position
carries no label. Optimisation is :class:`~retrieval.training.loop.Loop` (LoRA, resume, DDP).

Lists come from RankZephyr-format files (:func:`read_ranked_lists`) or from a run and qrels in the store
(:func:`qrels_lists`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from ..data.collections import iter_lines, parse_json_object
from ..fields import like
from ..models.backbones import Backbone
from ..training.loop import Loop, LoopSettings
from .rerankers import Encoded, RerankerName, RerankError, make_reranker, position_logits


@dataclass
class RankedList:
    """A query and its candidates' texts, best first; ``labels`` (graded relevance, same order) when known."""

    query_id: str
    query: str
    docs: list[str]
    labels: list[float] | None = None


# ------------------------------------------------------------------------------------------------- sources
_PASSAGE = re.compile(r"^\[(\d+)\]\s?(.*)$", re.MULTILINE)
_QUERY = re.compile(r"Search Query:\s*(.+?)\s*$", re.MULTILINE)
_RANK = re.compile(r"\[(\d+)\]")


def parse_ranked_list(obj: Mapping[str, Any], where: str) -> RankedList:
    """One ranked list from a JSON object: RankZephyr's conversations (the user turn lists ``[i] passage`` lines
    and ``Search Query: ...``, the assistant's answer is ``[4] > [2] > ...``), or a plain object ``{"query",
    "candidates": [text or {"text"|"content"|"passage"}], "ranking"?: 1-based order, "labels"?}`` (no ranking:
    the candidates are best first).

    >>> parse_ranked_list({"conversations": [{"from": "human", "value": "[1] cats\\n[2] dogs\\nSearch Query: dog."},
    ...                                      {"from": "gpt", "value": "[2] > [1]"}]}, "x").docs
    ['dogs', 'cats']
    >>> parse_ranked_list({"query": "q", "candidates": ["a", {"text": "b"}], "ranking": [2, 1]}, "x").docs
    ['b', 'a']
    """
    qid = str(obj.get("id", obj.get("query_id", obj.get("qid", where))))
    if "conversations" in obj:
        turns = obj["conversations"]
        user = [t.get("value", "") for t in turns if t.get("from") in ("human", "user")]
        answer = [t.get("value", "") for t in turns if t.get("from") in ("gpt", "assistant")]
        if not user or not answer:
            raise RerankError(f"{where}: a conversation needs a user turn and an assistant turn")
        found = _PASSAGE.findall(user[-1])
        query = _QUERY.search(user[-1])
        if not found or query is None:
            raise RerankError(f"{where}: no '[i] passage' lines or no 'Search Query:' in the user turn")
        docs = {int(i): text.strip() for i, text in found}
        ranking = [int(i) for i in _RANK.findall(answer[-1])]
        return _ordered(qid, query.group(1).rstrip("."), docs, ranking, None, where)
    if "query" not in obj:
        raise RerankError(f"{where}: neither 'conversations' nor 'query' (RankZephyr or plain ranked lists)")
    cands = obj.get("candidates", obj.get("documents", obj.get("passages", obj.get("hits"))))
    if not isinstance(cands, list) or not cands:
        raise RerankError(f"{where}: 'candidates' must be a non-empty list")
    texts = []
    for c in cands:
        text = c if isinstance(c, str) else next((c[k] for k in ("text", "content", "passage") if k in c), None)
        if not isinstance(text, str):
            raise RerankError(f"{where}: a candidate without text: {str(c)[:80]}")
        texts.append(text)
    labels = obj.get("labels")
    ranking = obj.get("ranking") or list(range(1, len(texts) + 1))
    docs = dict(enumerate(texts, start=1))
    return _ordered(qid, str(obj["query"]), docs, [int(r) for r in ranking], labels, where)


def _ordered(
    qid: str, query: str, docs: dict[int, str], ranking: list[int], labels: list[Any] | None, where: str
) -> RankedList:
    seen = list(dict.fromkeys(r for r in ranking if r in docs))
    if len(seen) != len(ranking) or not seen:
        raise RerankError(f"{where}: the ranking {ranking[:25]} names unknown or repeated candidates (1..{len(docs)})")
    order = seen + [i for i in sorted(docs) if i not in set(seen)]  # unranked candidates last, in their order
    lab = None
    if labels is not None:
        if len(labels) != len(docs):
            raise RerankError(f"{where}: {len(labels)} labels for {len(docs)} candidates")
        lab = [float(labels[i - 1]) for i in order]
    return RankedList(qid, query, [docs[i] for i in order], lab)


def read_ranked_lists(path: str | Path) -> Iterator[RankedList]:
    """Ranked lists from a JSON lines file (``.jsonl`` or ``.jsonl.gz``; RankZephyr's training data as published,
    or plain objects, see :func:`parse_ranked_list`); a malformed line fails naming the file and line."""
    p = Path(path)
    for n, line in iter_lines(p):
        yield parse_ranked_list(parse_json_object(p, n, line), f"{p}:{n}")


def qrels_lists(
    queries: Mapping[str, str],
    judged: Mapping[str, Mapping[str, int]],
    ranked: Mapping[str, Sequence[str]],
    text_of: Mapping[str, str],
    size: int,
) -> tuple[list[RankedList], dict[str, int]]:
    """Teacher lists from qrels over a first-stage run: each judged query's relevant documents (grade > 0, best
    grade first, then in the run's order), then the run's other documents in its order, ``size`` in all; the
    labels are the grades (0 for the rest). Queries without a relevant document in the corpus are left out.

    >>> lists, stats = qrels_lists({"q": "cat"}, {"q": {"d3": 1}}, {"q": ["d1", "d2", "d3"]},
    ...                            {"d1": "a", "d2": "b", "d3": "c"}, 2)
    >>> lists[0].docs, lists[0].labels, stats["lists"]
    (['c', 'a'], [1.0, 0.0], 1)
    """
    out, stats = [], {"lists": 0, "without_relevant": 0, "without_run": 0}
    for q, grades in judged.items():
        if q not in queries:
            continue
        run = list(ranked.get(q, []))
        if not run:
            stats["without_run"] += 1
        rel = [d for d, g in grades.items() if g > 0 and d in text_of]
        if not rel:
            stats["without_relevant"] += 1
            continue
        position = {d: i for i, d in enumerate(run)}
        rel.sort(key=lambda d: (-grades[d], position.get(d, len(run)), d))
        rest = [d for d in run if grades.get(d, 0) <= 0 and d in text_of]
        docs = (rel + rest)[:size]
        out.append(
            RankedList(q, queries[q], [text_of[d] for d in docs], [float(max(0, grades.get(d, 0))) for d in docs])
        )
        stats["lists"] += 1
    return out, stats


def run_lists(
    queries: Mapping[str, str], ranked: Mapping[str, Sequence[str]], text_of: Mapping[str, str], size: int
) -> list[RankedList]:
    """Teacher lists from a run alone (distillation from a stronger first stage): each query's top ``size``
    documents in the run's order, no labels.

    >>> [ls.docs for ls in run_lists({"q": "cat"}, {"q": ["d2", "d1", "d3"]}, {"d1": "a", "d2": "b", "d3": "c"}, 2)]
    [['b', 'a']]
    """
    out = []
    for q, docs in ranked.items():
        keep = [d for d in docs if d in text_of][:size]
        if q in queries and keep:
            out.append(RankedList(q, queries[q], [text_of[d] for d in keep]))
    return out


# ------------------------------------------------------------------------------------------------- losses
def listwise_ce(scores: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """Softmax cross-entropy of one list's scores (teacher order) against its labels normalised to sum 1, or
    against the first document when there are no (positive) labels.

    >>> round(float(listwise_ce(torch.tensor([0.0, 0.0]), None)), 4)  # log 2
    0.6931
    >>> round(float(listwise_ce(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0]))), 4)
    1.0514
    """
    logp = torch.log_softmax(scores, dim=-1)
    if labels is None or float(labels.sum()) <= 0:
        return -logp[0]
    target = labels / labels.sum()
    return -(target * logp).sum()


def ranknet(scores: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
    """RankNet: the mean of log(1 + exp(s_j - s_i)) over the pairs the teacher orders (label_i > label_j, or
    i before j without labels); None when no pair is ordered.

    >>> round(float(ranknet(torch.tensor([1.0, 0.0]), None)), 4)  # log(1 + e^-1)
    0.3133
    >>> ranknet(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])) is None
    True
    """
    n = scores.shape[0]
    i, j = torch.triu_indices(n, n, offset=1)
    if labels is not None:
        keep = labels[i] != labels[j]
        i, j = i[keep], j[keep]
        swap = labels[i] < labels[j]
        i, j = torch.where(swap, j, i), torch.where(swap, i, j)
    if i.numel() == 0:
        return None
    return F.softplus(scores[j] - scores[i]).mean()


# ------------------------------------------------------------------------------------------------- settings
class RerankTrainSettings(LoopSettings):
    """A reranker's training (DiffuRank's defaults: LoRA r 16, alpha 32, dropout 0, AdamW at a constant 1e-4,
    weight decay 0.01, 3 epochs, 64 lists a step)."""

    method: RerankerName = Field(default="pointwise", description="The reranker trained (its prompt and slots).")
    loss: Literal["listwise_ce", "ranknet", "mdlm"] | None = Field(
        default=None,
        description="listwise_ce or ranknet (pointwise, logits_listwise), mdlm (permutations); "
        "default: listwise_ce, or mdlm for the permutation methods.",
    )
    masking: Literal["docid", "random"] = Field(
        default="docid",
        description="MDLM SFT: mask identifier slots only (docid) or any answer token (random, the ablation).",
    )
    list_size: int = Field(default=20, ge=2, description="Candidates per list (the teacher's top).")
    doc_tokens: int = Field(default=128, ge=1, description="Tokens of each document in a prompt.")
    prompt: str | None = Field(
        default=None, description="A built-in rerank prompt or YAML file (default: the method's)."
    )
    schedule: Literal["constant", "linear"] = Field(
        default="constant", description="constant lr (DiffuRank), or linear warm-up and decay."
    )
    lora_alpha: int = like(LoopSettings, "lora_alpha", default=32)
    lora_dropout: float = like(LoopSettings, "lora_dropout", default=0.0)
    warmup_ratio: float = like(LoopSettings, "warmup_ratio", default=0.0)
    epochs: float = Field(default=3.0, gt=0, description="Passes over the lists (fractions allowed).")
    batch_size: int = Field(default=8, ge=1, description="Lists per micro-batch.")
    grad_accum: int = like(LoopSettings, "grad_accum", default=8)

    @model_validator(mode="after")
    def _loss_fits(self) -> RerankTrainSettings:
        perm = self.method.startswith("permutation")
        if self.loss is None:
            self.loss = "mdlm" if perm else "listwise_ce"
        if perm != (self.loss == "mdlm"):
            raise ValueError(
                f"loss {self.loss} does not train {self.method}: use mdlm for the permutation methods, "
                "listwise_ce or ranknet for pointwise and logits_listwise"
            )
        return self

    def lr_factor(self, step: int, steps: int) -> float:
        """Constant after any warm-up (``schedule`` constant), else the linear schedule.

        >>> RerankTrainSettings().lr_factor(5, 10)
        1.0
        """
        if self.schedule == "linear":
            return super().lr_factor(step, steps)
        warm = int(steps * self.warmup_ratio)
        return (step + 1) / (warm + 1) if step < warm else 1.0


# ------------------------------------------------------------------------------------------------- trainer
@dataclass
class RerankBatch:
    """A micro-batch: prompt rows and the positions read; per list, the score indices in teacher order and its
    labels (score losses), or per row the target token at each read position and the row's weight (MDLM)."""

    rows: list[list[int]]
    positions: list[list[int]]
    lists: list[tuple[list[int], list[float] | None]] = field(default_factory=list)
    targets: list[list[int]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    n_lists: int = 0


class RerankTrainer(Loop):
    """Trains a backbone as one of DiffuRank's rerankers on ranked lists (see the module's description).

    >>> RerankTrainSettings(method="permutation_assignment").loss
    'mdlm'
    """

    def __init__(self, bb: Backbone, lists: Sequence[RankedList], settings: RerankTrainSettings):
        lists = [ls for ls in lists if len(ls.docs) >= 2]
        if not lists:
            raise RerankError("no ranked list with two or more candidates to train on")
        # the prompt, its single-token answers / identifiers and the context are checked before any training
        self.reranker = make_reranker(
            settings.method, bb, prompt=settings.prompt, doc_tokens=settings.doc_tokens, window=settings.list_size
        )
        self.builder = self.reranker.builder
        self.cols: list[int] = list(self.reranker.cols)  # type: ignore[attr-defined]
        super().__init__(bb, lists, settings)
        self.s: RerankTrainSettings = settings
        self.tail = len(self.builder.tail)

    @staticmethod
    def samples(prepared: RerankBatch) -> int:
        return prepared.n_lists

    def prepare(self, lists: list[RankedList], step: int) -> RerankBatch:
        s = self.s
        out = RerankBatch([], [], n_lists=len(lists))
        for ls in lists:
            rng = random.Random(f"{s.seed}:{step}:{ls.query_id}")
            docs = ls.docs[: s.list_size]
            labels = ls.labels[: s.list_size] if ls.labels is not None else None
            n = len(docs)
            if s.method == "pointwise":
                first = sum(len(p) for p in out.positions)
                for d in docs:
                    enc = self.builder.pointwise(ls.query, d)
                    out.rows.append(enc.ids)
                    out.positions.append(enc.slots)
                out.lists.append((list(range(first, first + n)), labels))
                continue
            shown = list(range(n))
            rng.shuffle(shown)  # shown[k] = the teacher rank of the k-th document in the prompt
            if s.method == "logits_listwise":
                first = sum(len(p) for p in out.positions)
                enc = self.builder.listwise(ls.query, [docs[i] for i in shown])
                out.rows.append(enc.ids)
                out.positions.append(enc.slots)
                slot_of = {t: k for k, t in enumerate(shown)}
                out.lists.append(([first + slot_of[t] for t in range(n)], labels))
                continue
            self._mdlm_row(out, ls.query, docs, shown, rng)
        return out

    def _mdlm_row(self, out: RerankBatch, query: str, docs: list[str], shown: list[int], rng: random.Random) -> None:
        n = len(docs)
        idents = self.reranker.window_ids(n)  # type: ignore[attr-defined]
        enc: Encoded = self.builder.listwise(query, [docs[i] for i in shown], idents)
        ident_of = {t: k for k, t in enumerate(shown)}  # teacher rank -> the identifier index it is shown under
        target = list(enc.ids)
        for r, slot in enumerate(enc.slots):
            target[slot] = self.cols[ident_of[r]]
        if self.s.masking == "docid":
            span = list(enc.slots)
        else:
            span = list(range(enc.slots[0], len(target)))  # the whole answer, separators and closing tokens too
        t = 1.0 - rng.random()  # (0, 1]
        masked = [p for p in span if rng.random() < t] or [span[rng.randrange(len(span))]]
        ids = list(target)
        for p in masked:
            ids[p] = self.bb.mask_id
        out.rows.append(ids)
        out.positions.append(masked)
        out.targets.append([target[p] for p in masked])
        out.weights.append(1.0 / (t * len(span)))

    def micro_loss(self, x: RerankBatch, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.autocast(self.bb.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = position_logits(self.bb, x.rows, x.positions)
        lsm = torch.log_softmax(logits.float(), dim=-1)
        if self.s.loss == "mdlm":
            tgt = torch.as_tensor([t for row in x.targets for t in row], device=lsm.device)
            nll = -lsm.gather(1, tgt[:, None])[:, 0]
            weight = torch.as_tensor(
                [w for w, row in zip(x.weights, x.targets, strict=True) for _ in row],
                device=lsm.device,
                dtype=nll.dtype,
            )
            loss = (nll * weight).sum() / len(x.targets)
            return loss, {"loss": float(loss.detach())}
        cols = torch.as_tensor(self.cols, device=lsm.device)
        scores = lsm[:, cols[1]] - lsm[:, cols[0]]  # log p1 - log p0 at each slot
        losses = []
        for idx, labels in x.lists:
            s = scores[torch.as_tensor(idx, device=scores.device)]
            lab = torch.as_tensor(labels, device=s.device, dtype=s.dtype) if labels is not None else None
            one = listwise_ce(s, lab) if self.s.loss == "listwise_ce" else ranknet(s, lab)
            if one is not None:
                losses.append(one)
        loss = torch.stack(losses).mean() if losses else scores.sum() * 0.0
        return loss, {"loss": float(loss.detach())}
