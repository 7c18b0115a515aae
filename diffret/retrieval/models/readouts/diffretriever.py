"""DiffRetriever's readout (paper §3.2): K [MASK] slots after the prompt, one bidirectional pass (or S denoising
steps); the slots' hidden states are the dense multi-vector, their logits the sparse vector.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..backbones import Backbone, softmax_stats
from ..sparse import (
    per_position_lists,
    per_position_sparse_tensors,
    pooled_weights,
    topk_sparse,
)
from .base import (
    DEFAULT_MAX_LENGTH,
    HEAD_CHUNK_BYTES,
    Batch,
    Encoded,
    HostCopy,
    Pending,
    Prepared,
    Readout,
    TrainReps,
    all_real,
    pad_rows,
    staged,
    to_device,
)
from .config import ReadoutConfig


class DiffRetrieverReadout(
    Readout,
    name="diffretriever",
    multi_vector=True,
    has_sparse=True,
    needs_causal_lm=False,
    uses_prompt=True,
    k_values="grid",
    k_meaning="the number of [MASK] slots appended to the prompt (one vector each)",
    adapts_prompt=True,
):
    """DiffRetriever (paper section 3.2, eq. 1-2): K [MASK] slots after the prompt, one bidirectional pass.

    The hidden states at the K mask positions are the dense multi-vector; the LM head is applied at those
    positions only, for the sparse vector and the argmax token of each slot. ``denoise_steps`` S > 1 unmasks
    by confidence over S passes (appendix A.1).
    """

    def __init__(self, backbone: Backbone, config: ReadoutConfig, max_length: int = DEFAULT_MAX_LENGTH):
        super().__init__(backbone, config, max_length)
        self._mask_id = backbone.mask_id  # fail early: a masked readout needs a mask token
        self._stop = torch.zeros(0, dtype=torch.long)
        if self.cfg.stop_cut:
            self._stop = torch.as_tensor(sorted(backbone.stop_ids), dtype=torch.long, device=backbone.device)

    def overhead(self, side: str, k: int) -> tuple[int, int]:
        p = self.pieces(side, k)
        return len(p.prefix) + len(p.suffix), k + len(p.closing)

    def _mask_batch(self, token_ids: list[list[int]], side: str, k: int, device: torch.device | None = None) -> Batch:
        """The padded inputs with K masks after each text, on ``device`` (default: the model's)."""
        device = self.bb.device if device is None else device
        p = self.pieces(side, k)
        masks = [self._mask_id] * k
        rows = [list(p.prefix) + list(t) + list(p.suffix) + masks + list(p.closing) for t in token_ids]
        ids, att, offs = pad_rows(rows, self.bb.pad_id, self.cfg.padding_side, device)
        starts = [off + len(p.prefix) + len(t) + len(p.suffix) for off, t in zip(offs, token_ids, strict=True)]
        positions = to_device(torch.as_tensor([[s + j for j in range(k)] for s in starts]), device)
        return Batch(ids, att, positions, [len(r) for r in rows])

    def train_forward(self, token_ids: list[list[int]], side: str, k: int) -> TrainReps:
        """With gradients, for training: the hidden states and logits at the K masks (all K slots, no stop cut,
        as the reference trains). With S > 1 denoising steps the first S - 1 run without gradients and the
        loss reads the final step: the slots it reveals carry gradients, the ones frozen earlier do not."""
        b = self._mask_batch(self._fit(token_ids, side, k), side, k)
        if self.cfg.denoise_steps > 1:
            h, logits, _ = self._denoise(b, k, self.cfg.denoise_steps, grad_final=True)
            return TrainReps(h, all_real(h), logits)
        hidden = self.bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=True)
        h = hidden[torch.arange(len(token_ids), device=hidden.device)[:, None], b.positions]
        return TrainReps(h, all_real(h), self.bb.logits(h))

    def prepare(
        self, token_ids: list[list[int]], texts: Sequence[str | Sequence[int]] | None, side: str, k: int
    ) -> Prepared:
        """The padded inputs and each chunk of texts' candidate ids, made on the host (a thread of ``encode_rows``
        while the model runs the previous batch) and staged for the device: no small copy per text reaches it."""
        out = super().prepare(token_ids, texts, side, k)
        if out.token_ids:
            host, dev = torch.device("cpu"), self.bb.device
            b = self._mask_batch(out.token_ids, side, k, host)
            out.mask_batch = Batch(
                staged(b.input_ids, dev), staged(b.attention_mask, dev), staged(b.positions, dev), b.lengths
            )
            # numpy, not torch, in this thread: torch's intra-op threads would contend with the model's
            cands = [c.numpy() for c in self._candidates(texts, len(out.token_ids), host)]
            width = max(1, max(len(c) for c in cands))
            step = max(1, HEAD_CHUNK_BYTES // (k * width * 4))  # a bounded number of texts' candidate logits at once
            out.chunks = []
            for s in range(0, len(cands), step):
                chunk = cands[s : s + step]
                union = np.unique(np.concatenate(chunk))  # sorted
                ids = np.full((len(chunk), max(len(c) for c in chunk)), -1, dtype=np.int64)  # [b, C], -1: none
                for j, c in enumerate(chunk):
                    ids[j, : len(c)] = c
                out.chunks.append((s, staged(torch.from_numpy(union), dev), staged(torch.from_numpy(ids), dev)))
        return out

    @torch.inference_mode()
    def run(self, batch: Prepared) -> list[Encoded]:
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: Prepared) -> Pending:
        """The batch's device work, queued: the trunk, the head at the masks (argmax, the candidates' logits), the
        kept slots and the sparse vectors, all on the device; their results start back to the host in one
        asynchronous copy (:class:`HostCopy`), which :meth:`Pending.result` waits for once. On a CPU the same code
        runs eagerly (the copy is the tensors themselves)."""
        if not batch.token_ids:
            return Pending(list)
        dev, k, n_texts = self.bb.device, batch.k, len(batch.token_ids)
        b, chunks = batch.mask_batch, batch.chunks
        assert b is not None and chunks is not None
        b = Batch(to_device(b.input_ids, dev), to_device(b.attention_mask, dev), to_device(b.positions, dev), b.lengths)
        logits: torch.Tensor | None = None
        decoded: torch.Tensor | None = None
        if self.cfg.denoise_steps == 1:
            hidden = self.bb.hidden_states(b.input_ids, b.attention_mask, bidirectional=True)
            rows = torch.arange(n_texts, device=dev)[:, None]
            h = hidden[rows, b.positions]  # [B, K, H]
            # logits and decoded stay None: the head below reads the argmax and the candidates' logits only
        else:
            h, logits, decoded = self._denoise(b, k, self.cfg.denoise_steps)
        # float16 as stored: on a GPU cast there (one copy of half the bytes); on a CPU by numpy, as it always was
        dense = h.to(torch.float16) if h.is_cuda else h.float()
        sent: list[torch.Tensor] = [dense]  # what goes back to the host, in one copy
        parts = []  # per chunk: (first text, where its tensors start in sent, head stats?, pooled sparse vectors)
        for s, union, ids in chunks:
            union, ids = to_device(union, dev), to_device(ids, dev)
            e = s + ids.shape[0]
            ent = top_p = None
            if logits is None and batch.head_stats:
                toks, at, ent, top_p = self.bb.read_head(h[s:e], union, stats=True)
            elif logits is None:
                toks, at = self.bb.read_head(h[s:e], union)  # [b, K], [b, K, U]
            else:
                assert decoded is not None  # the denoising loop gives both
                toks, at = decoded[s:e], logits[s:e][..., union].float()
                if batch.head_stats:
                    ent, top_p = softmax_stats(logits[s:e])
            slots = self._slots(toks, k)  # [b], on the device
            cols = torch.searchsorted(union, ids.clamp(min=0))  # each text's candidates, as columns of the union
            cand_logits = at.gather(2, cols[:, None, :].expand(-1, k, -1))  # [b, K, C]
            sparse = self._sparse_batch(ids, cand_logits, slots, k)
            parts.append((s, len(sent), ent is not None, None if isinstance(sparse, tuple) else sparse))
            sent += [slots, toks.to(torch.int32), *(sparse if isinstance(sparse, tuple) else ())]
            sent += [] if ent is None or top_p is None else [ent.float(), top_p.float()]
        copy = HostCopy(sent)

        def finish() -> list[Encoded]:
            got = [t.numpy() for t in copy.wait()]
            dense_np = got[0] if got[0].dtype == np.float16 else got[0].astype(np.float16)
            out: list[Encoded] = []
            for s, at_, has_stats, pooled in parts:
                cuts, tokens = got[at_].tolist(), got[at_ + 1]
                pairs = per_position_lists(*got[at_ + 2 : at_ + 5]) if pooled is None else pooled
                stats = got[at_ + (2 if pooled is not None else 5) :][:2] if has_stats else None
                for j, (n, (sp_ids, sp_w)) in enumerate(zip(cuts, pairs, strict=True)):
                    i = s + j
                    enc = Encoded(dense_np[i, :n], sp_ids, sp_w, b.lengths[i], stopped=n < k, tokens=tokens[j])
                    if stats is not None:
                        enc.entropy, enc.maxprob = stats[0][j], stats[1][j]
                    out.append(enc)
            return out

        return Pending(finish)

    def _candidates(
        self, texts: Sequence[str | Sequence[int]] | None, n: int, device: torch.device
    ) -> list[torch.Tensor]:
        """Each text's candidate vocabulary ids, sorted: its content words' (:meth:`allowed`), or the whole
        vocabulary when there is no filter."""
        out = [self.allowed(texts[i] if texts else None, device) for i in range(n)]
        if all(c is not None for c in out):
            return out  # type: ignore[return-value]
        every = torch.arange(self.bb.vocab_size, device=device)
        if self.cfg.sparse == "per_position":  # the per-slot path never keeps the mask; the pooled one reads all
            every = every[every != self._mask_id]
        return [every if c is None else c for c in out]

    def _sparse_batch(
        self, ids: torch.Tensor, logits: torch.Tensor, slots: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | list[tuple[np.ndarray, np.ndarray]]:
        """The sparse vectors of a chunk of texts from their candidates' logits (see :meth:`sparse_from`): per slot
        (the default), as device tensors (:func:`per_position_sparse_tensors`); pooled, as each text's arrays."""
        topk, quantise = int(self.cfg.sparse_topk or 128), str(self.cfg.sparse_quantise)
        if self.cfg.sparse == "per_position":
            return per_position_sparse_tensors(ids, logits, slots, topk, quantise, pooled_bf16=k > 1)
        out = []
        for j, n in enumerate(slots.tolist()):  # pooled: a text at a time (reads back as it goes)
            real = ids[j] >= 0
            sp_ids, sp_w = topk_sparse(pooled_weights(logits[j, :n][:, real]), None, topk, quantise)
            out.append((ids[j, real].cpu().numpy().astype(np.int32)[sp_ids], sp_w))
        return out

    def _slots(self, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """The slots each text keeps ([B, K] tokens read; [B] on their device): up to its first special token (none
        read, or at the first slot: all K)."""
        if not self._stop.numel():
            return torch.full((tokens.shape[0],), k, dtype=torch.long, device=tokens.device)
        hit = torch.isin(tokens, self._stop)
        first = torch.where(hit.any(-1), hit.int().argmax(-1), k)  # argmax: the first of the maxima
        return torch.where(first > 0, first, k)

    def _denoise(
        self, b: Batch, k: int, steps: int, grad_final: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's S-step unmasking: at each step the most confident masked slots (negative entropy of the
        prediction) take their argmax token, ``max(1, int(n_masked * (1 - s / t)))`` of them on the timesteps
        ``linspace(1, 1e-3, S + 1)``, all that remain at the last step; a slot's hidden state and logits are
        frozen at the step that reveals it. Returns (hidden [B, K, H], logits [B, K, V], tokens [B, K]).
        ``grad_final``: the steps before the last run without gradients (training reads the last one)."""
        ids = b.input_ids.clone()
        bsz = ids.shape[0]
        rows = torch.arange(bsz, device=ids.device)[:, None]
        times = torch.linspace(1, 1e-3, steps + 1)
        hidden_buf: torch.Tensor | None = None
        logit_buf: torch.Tensor | None = None
        for s in range(steps):
            with torch.set_grad_enabled(torch.is_grad_enabled() and (not grad_final or s == steps - 1)):
                step_ids = ids.clone() if torch.is_grad_enabled() else ids  # ids change in place below
                hidden = self.bb.hidden_states(step_ids, b.attention_mask, bidirectional=True)
                h = hidden[rows, b.positions]
                logits = self.bb.logits(h).float()  # [B, K, V]
            if hidden_buf is None:
                hidden_buf = torch.zeros(h.shape, dtype=h.dtype, device=h.device)
                logit_buf = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
            probs = logits.detach().softmax(-1)
            tok = probs.argmax(-1)
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)  # negative entropy
            slot_ids = ids[rows, b.positions]
            masked = slot_ids == self._mask_id
            for i in range(bsz):
                n_masked = int(masked[i].sum())
                if not n_masked:
                    continue
                take = n_masked if s == steps - 1 else max(1, int(n_masked * (1 - float(times[s + 1] / times[s]))))
                cand = conf[i].masked_fill(~masked[i], float("-inf"))
                pick = torch.topk(cand, min(take, n_masked)).indices
                hidden_buf[i, pick] = h[i, pick]  # in place: with gradients, the buffer joins the graph
                logit_buf[i, pick] = logits[i, pick]  # type: ignore[index]
                ids[i, b.positions[i, pick]] = tok[i, pick]
        assert hidden_buf is not None and logit_buf is not None
        return hidden_buf, logit_buf, ids[rows, b.positions]
