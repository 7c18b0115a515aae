"""The contrastive :class:`Trainer`: a readout's backbone trained on Tevatron groups (InfoNCE over pools of
in-batch and hard negatives, gathered across processes; SIDR's objective and in-training retrieval), a pool
larger than ``batch_size`` by gradient caching."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from ...data.collections import passage_text
from ...data.training import Group, sample_fill
from ...models.backbones import PASSAGE_ENCODER
from ...models.encoding import quiet_length_warning
from ...models.readouts import Readout
from ..negatives import RetrievedNegatives, sparse_rows
from ..objective import contrastive_loss, sidr_loss, sparse_vectors, topk_own
from . import gradcache
from .base import Loop
from .distributed import gather
from .settings import BASELINES, TrainSettings

T = TypeVar("T")


@dataclass
class Prepared:
    """One micro-batch's inputs: token ids, the group size, the content words' vocabulary ids (sparse loss), and
    the texts (RepLLaMA tokenizes its prefix and the text as one string)."""

    query_ids: list[list[int]]
    passage_ids: list[list[int]]
    group: int
    query_allowed: list[list[int]] | None = None
    passage_allowed: list[list[int]] | None = None
    query_texts: list[str] | None = None
    passage_texts: list[str] | None = None
    groups: list[Group] | None = None  # the groups themselves (retrieved negatives need their ids)
    retrieved: bool = False  # the negatives were retrieved (:meth:`Trainer.retrieve`)

    def chunk(self, start: int, end: int) -> Prepared:
        """Groups ``start:end`` (their queries and their passages)."""
        g = self.group

        def rows(xs: list[T], n: int = 1) -> list[T]:
            return xs[start * n : end * n]

        def cut(xs: list[T] | None, n: int = 1) -> list[T] | None:
            return None if xs is None else rows(xs, n)

        return Prepared(
            rows(self.query_ids),
            rows(self.passage_ids, g),
            g,
            cut(self.query_allowed),
            cut(self.passage_allowed, g),
            cut(self.query_texts),
            cut(self.passage_texts, g),
            cut(self.groups),
            self.retrieved,
        )


class Trainer(Loop):
    """Contrastive training of a readout's backbone on groups (every readout: the mask readout, S > 1
    included, PromptReps, DiffEmbed, RepLLaMA); ``run`` resumes from a checkpoint when given one.

    Settings left at None / ``auto`` take the readout's reference values (:meth:`TrainSettings.resolved`). A pool
    larger than ``batch_size`` groups per process is trained by gradient caching (GradCache, Gao et al. 2021, as
    Tevatron offers it): the pool is encoded in chunks of ``batch_size`` without gradients, the loss over the
    whole pool gives the gradient of every representation, then each chunk is encoded again with gradients (the
    same dropout masks) and backpropagates its representations' gradients. Loss and gradients equal one pass over
    the whole pool; memory is one chunk's activations plus the pool's representations.
    """

    def __init__(
        self,
        reader: Readout,
        groups: Sequence[Group],
        settings: TrainSettings,
        negatives: RetrievedNegatives | None = None,
    ):
        if not groups:
            raise ValueError("no training groups")
        if (negatives is not None) != (settings.retrieved_negatives is not None):
            raise ValueError("retrieved negatives need both the setting (its depth) and the bag-of-tokens index")
        if negatives is not None and reader.name != "sidr":
            raise ValueError(
                f"retrieved negatives are SIDR's in-training retrieval: train --readout sidr (got {reader.name})"
            )
        settings = settings.resolved(reader.name)  # SIDR's sets K = 1 (one vector per text)
        if settings.kq is None or settings.kp is None:
            raise ValueError("training needs a budget: give kq and kp (the train stage takes the zero-shot selection)")
        reader.check_k([settings.kq])
        reader.check_k([settings.kp])
        if settings.encoders == "separate":  # before the loop collects the parameters: the optimizer takes both
            if reader.name != "sidr" or settings.adapter != "full":
                raise ValueError(
                    "separate query and passage encoders are SIDR's: --readout sidr with full fine-tuning"
                    f" (got {reader.name}, {settings.adapter})"
                )
            reader.separate()  # type: ignore[attr-defined]
        elif settings.encoders == "shared" and reader.name == "sidr" and reader.passage_bb is not None:  # type: ignore[attr-defined]
            raise ValueError("this model has a separately trained passage encoder; train it with separate encoders")
        self.r = reader
        self.baseline = reader.name in BASELINES
        self.sidr = reader.name == "sidr"  # SIDR's semi-parametric objective (objective.sidr_loss)
        self.negatives = negatives
        super().__init__(reader.bb, groups, settings)
        self.s: TrainSettings = settings
        for side, k in (("query", settings.kq), ("passage", settings.kp)):
            reader.pieces(side, k)  # the prompt's tokens, before the prefetch thread shares the tokenizer

    @staticmethod
    def samples(prepared: Prepared) -> int:
        return len(prepared.query_ids)

    def extra_models(self) -> dict[str, torch.nn.Module]:
        """SIDR's separately trained passage encoder (``passage_encoder/``), taken off the query model."""
        twin = self.r.detach_passage_encoder() if self.sidr else None  # type: ignore[attr-defined]
        return {} if twin is None else {PASSAGE_ENCODER: twin.eval()}

    def _text(self, p: dict[str, Any]) -> str:
        """A training passage as the reference's trainers build it: title + sep + text (the title alone without a
        text; train_diffretriever.py L307-310), the text alone for the baselines (train_diffembed.py L73-82)."""
        if self.baseline:
            return p["text"]
        return passage_text(
            p["title"], p["text"], self.s.train_title_sep if self.s.train_title_sep is not None else " "
        )

    def _passages(self, g: Group, step: int) -> list[str]:
        rng = random.Random(f"{self.s.seed}:{step}:{g.query_id}")
        pos = rng.choice(g.positives)
        negs = sample_fill(rng, g.negatives, int(self.s.n_negatives or 0))
        return [self._text(p) for p in [pos, *negs]]

    def _limit(self, side: str, k: int, n: int) -> int:
        """Text tokens kept: ``n``, or for the baselines ``n`` in all (their scripts count special tokens and
        RepLLaMA's prefix)."""
        if not self.baseline:
            return n
        counted, extra = self.r.overhead(side, k)
        return max(1, n - counted - extra)

    def _ids(self, texts: list[str], limit: int) -> list[list[int]]:
        quiet_length_warning(self.r.bb.tokenizer)
        ids = self.r.bb.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [list(t[:limit]) for t in ids]

    def _allowed(self, allowed: list[list[int]] | None, vocab: int) -> torch.Tensor | None:
        if allowed is None:
            return None
        out = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=self.r.bb.device)
        for i, ids in enumerate(allowed):
            out[i, [j for j in ids if j < vocab]] = True
        return out

    def prepare(self, groups: list[Group], step: int) -> Prepared:
        """A micro-batch's inputs (CPU work only: sampling, tokenisation, the content filter); a function of
        the groups and the step, so :meth:`train_step` prepares the next step's on a thread meanwhile."""
        s = self.s
        queries = [g.query for g in groups]
        passages = [t for g in groups for t in self._passages(g, step)]
        filt = self.r.filter if s.sparse_loss else None
        return Prepared(
            self._ids(queries, self._limit("query", s.kq, int(s.q_max_len))),  # type: ignore[arg-type]
            self._ids(passages, self._limit("passage", s.kp, int(s.p_max_len))),  # type: ignore[arg-type]
            len(passages) // len(groups),
            [filt.allowed_ids(t) for t in queries] if filt else None,
            [filt.allowed_ids(t) for t in passages] if filt else None,
            queries,
            passages,
            list(groups),
        )

    def _forward(self, ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> Any:
        kw: dict[str, Any] = {}
        if self.r.name == "promptreps":
            kw["stop"] = "none" if self.s.promptreps_decode == "fixed" else "reference"
        if self.r.name == "repllama":
            kw["texts"] = texts
        return self.r.train_forward(ids, side, k, **kw)

    def _reps(self, x: Prepared) -> tuple[torch.Tensor | None, ...]:
        """(query dense, mask, sparse, passage dense, mask, sparse) of a micro-batch, with gradients; SIDR: (query
        vector, its bag of tokens, None, passage vector, its bag of tokens, None)."""
        s = self.s
        if self.sidr:
            with torch.autocast(self.r.bb.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                qv, qb = self.r.train_vectors(x.query_ids, "query")  # type: ignore[attr-defined]
                pv, pb = self.r.train_vectors(x.passage_ids, "passage")  # type: ignore[attr-defined]
            return qv, qb, None, pv, pb, None
        with torch.autocast(self.r.bb.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            q = self._forward(x.query_ids, x.query_texts, "query", s.kq)  # type: ignore[arg-type]
            p = self._forward(x.passage_ids, x.passage_texts, "passage", s.kp)  # type: ignore[arg-type]
        qs = ps = None
        if s.sparse_loss and q.logits is not None and p.logits is not None:
            qs = sparse_vectors(q.logits, self._allowed(x.query_allowed, q.logits.shape[-1]), q.mask)
            ps = sparse_vectors(p.logits, self._allowed(x.passage_allowed, p.logits.shape[-1]), p.mask)
        return q.dense, q.mask, qs, p.dense, p.mask, ps

    def _loss(self, reps: tuple[torch.Tensor | None, ...], group: int) -> tuple[torch.Tensor, dict[str, float]]:
        """InfoNCE of this rank's queries against the pool (every rank's passages when ``gather``)."""
        qd, qm, qs, pd, pm, ps = reps
        assert qd is not None and qm is not None and pd is not None and pm is not None  # only the sparse may be None
        pool = self.world if self.s.gather == "yes" else 1
        if self.sidr:  # qm / pm: the bags of tokens
            offset = self.rank * qd.shape[0] if pool > 1 else 0
            topk = int(self.r.cfg.sparse_topk or 768)
            return sidr_loss(qd, qm, gather(pd, pool), gather(pm, pool), group, topk, offset)
        ph, ps = gather(pd, pool), gather(ps, pool)
        pm = pm if pool == 1 else gather(pm.float(), pool) > 0.5
        offset = self.rank * qd.shape[0] if pool > 1 else 0
        return contrastive_loss(qd, qm, ph, pm, group, tau=float(self.s.tau), q_sparse=qs, p_sparse=ps, offset=offset)  # type: ignore[arg-type]

    def micro_loss(self, groups: list[Group] | Prepared, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        x = self._ready(groups if isinstance(groups, Prepared) else self.prepare(groups, step), step)
        return self._loss(self._reps(x), x.group)

    def _ready(self, x: Prepared, step: int) -> Prepared:
        """The micro-batch as trained: with retrieved negatives, each group's negatives replaced by passages the
        current query encoder retrieves (:meth:`retrieve`)."""
        return x if self.negatives is None or x.retrieved else self.retrieve(x, step)

    def retrieve(self, x: Prepared, step: int) -> Prepared:
        """SIDR's in-training retrieval: the queries encoded by the current model (eval mode, no gradients), their
        top-k plus own tokens searched over the fixed bag-of-tokens index, and each group's negatives drawn from
        the top ``retrieved_negatives`` without its judged-relevant passages (seeded by step and query)."""
        assert self.negatives is not None and x.groups is not None
        model = self.r.bb.model
        was = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.autocast(self.r.bb.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                qv, qb = self.r.train_vectors(x.query_ids, "query")  # type: ignore[attr-defined]
        finally:
            model.train(was)
        queries = sparse_rows(topk_own(qv.float(), qb, int(self.r.cfg.sparse_topk or 768)))
        relevant = [{str(p["docid"]) for p in g.positives} for g in x.groups]
        rngs = [random.Random(f"{self.s.seed}:{step}:{g.query_id}:retrieved") for g in x.groups]
        picks = self.negatives.draw(queries, relevant, x.group - 1, rngs)
        ids, texts = list(x.passage_ids), list(x.passage_texts or [])
        limit = self._limit("passage", int(self.s.kp or 1), int(self.s.p_max_len))  # type: ignore[arg-type]
        for i, got in enumerate(picks):
            if got:
                new = [self._text(p) for p in got]
                a, b = i * x.group + 1, (i + 1) * x.group
                ids[a:b], texts[a:b] = self._ids(new, limit), new
        return replace(x, passage_ids=ids, passage_texts=texts or None, retrieved=True)

    def micro_backward(self, prepared: Any, step: int, n: int) -> dict[str, float]:
        """One pool's loss / n backpropagated: in one pass when this process's share fits ``batch_size`` groups,
        else by gradient caching (:meth:`cached_backward`)."""
        x = self._ready(prepared if isinstance(prepared, Prepared) else self.prepare(prepared, step), step)
        if len(x.query_ids) <= self.s.batch_size:
            return super().micro_backward(x, step, n)
        return self.cached_backward(x, n)

    def cached_backward(self, x: Prepared, n: int = 1) -> dict[str, float]:
        """Gradient caching over chunks of ``batch_size`` groups (:func:`gradcache.cached_backward`): the same loss
        and gradients as one pass. The masks (SIDR's: the bags of tokens), reps 1 and 4, take no gradient."""
        b = self.s.batch_size
        chunks = [x.chunk(i, min(i + b, len(x.query_ids))) for i in range(0, len(x.query_ids), b)]
        loss = functools.partial(self._loss, group=x.group)
        return gradcache.cached_backward(chunks, self._reps, loss, self.r.bb.device, n, constant=(1, 4))
