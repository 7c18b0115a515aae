"""PromptReps: greedy decoding after the assistant prefix with a KV cache, at most K slots."""

from __future__ import annotations

import numpy as np
import torch

from .base import (
    Encoded,
    Readout,
    TrainReps,
    pad_rows,
    to_float16,
)


class PromptRepsReadout(
    Readout,
    name="promptreps",
    multi_vector=True,
    has_sparse=True,
    needs_causal_lm=True,
    uses_prompt=True,
    k_values="one value",
    k_meaning="the cap N on the slots decoded one by one (e.g. --k 20 zero-shot)",
):
    """PromptReps: greedy decoding after the assistant prefix (KV cache), at most K slots (the cap N).

    Slot 0 is the hidden state at the opening quote (the last prompt token), slot t the hidden state at the
    t-th generated token; each slot's logits give the sparse vector. ``promptreps_stop``: ``reference`` keeps
    the slots up to the one that predicts the closing quote (the single-token ``"``) or a special token (the
    zero-shot encoder's); ``none`` decodes exactly K - 1 words and keeps all K slots (the reference's fine-tuned
    model, in training and in encoding); ``quote_in_token`` drops the slot that predicts any token
    containing the quote (unless it is the first).
    """

    def overhead(self, side: str, k: int) -> tuple[int, int]:
        p = self.pieces(side, k)
        return len(p.prefix) + len(p.suffix), k

    def stop_tokens(self, stop: str | None = None) -> set[int]:
        """The tokens whose prediction ends the words (see ``promptreps_stop``; ``stop`` overrides it)."""
        stop = stop or self.cfg.promptreps_stop
        if stop == "none":
            return set()
        cache = self.__dict__.setdefault("_stop_tokens", {})
        if stop not in cache:
            tok = self.bb.tokenizer
            if stop == "reference":
                quote = tok('"', add_special_tokens=False)["input_ids"]
                cache[stop] = self.bb.stop_ids | (set(quote) if len(quote) == 1 else set())
            else:
                vocab = tok.get_vocab().items()
                cache[stop] = {i for t, i in vocab if '"' in tok.convert_tokens_to_string([t])}
        return cache[stop]

    def _encode(self, token_ids: list[list[int]], texts: list[str] | None, side: str, k: int) -> list[Encoded]:
        """Greedy decoding with a KV cache (left padding); at most K steps (the cap N: 20 zero-shot, 4 fine-tuned)."""
        rows, H, L, G, n_reps, stopped = self._decode(token_ids, side, k)
        dense, tokens = to_float16(H), G.cpu().numpy().astype(np.int32)  # the batch's in one copy each, not a text's
        out_list = []
        for i, (n, stop) in enumerate(zip(n_reps.tolist(), stopped.tolist(), strict=True)):
            sp_ids, sp_w = self.sparse_from(L[i, :n].float(), texts[i] if texts else None, k)
            out_list.append(Encoded(dense[i, :n], sp_ids, sp_w, len(rows[i]), bool(stop), tokens[i]))
        return out_list

    def train_forward(self, token_ids: list[list[int]], side: str, k: int, stop: str = "none") -> TrainReps:
        """With gradients: the words are decoded greedily without gradients (the cap N = 4 of the paper's
        fine-tuning), then one causal pass over the prompt and the decoded words gives every slot's hidden state and
        logits at once (the states the KV-cached decoding reads). ``stop="none"`` (the reference's trainer,
        promptreps_trainable.py L493-529): exactly K - 1 words, all K slots; ``reference``: the words end at the
        closing quote and the slots after it are masked out."""
        token_ids = self._fit(token_ids, side, k)
        with torch.no_grad():
            rows, _, _, G, n_reps, _ = self._decode(token_ids, side, k, stop)
        t = G.shape[1]
        full = [r + G[i, : t - 1].tolist() for i, r in enumerate(rows)]  # the last decoded word is never read
        ids, att, offs = pad_rows(full, self.bb.pad_id, "left", self.bb.device)
        hidden = self.bb.hidden_states(ids, att, bidirectional=False)
        pos = torch.as_tensor(
            [[o + len(r) - 1 + j for j in range(t)] for o, r in zip(offs, rows, strict=True)], device=ids.device
        )
        h = hidden[torch.arange(len(rows), device=ids.device)[:, None], pos]
        mask = torch.arange(t, device=ids.device)[None, :] < n_reps[:, None]
        return TrainReps(h, mask, self.bb.logits(h))

    def _decode(
        self, token_ids: list[list[int]], side: str, k: int, stop_rule: str | None = None
    ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input rows, hidden [B, T, H], logits [B, T, V], decoded [B, T], slots kept [B], stopped [B]);
        ``stop_rule`` overrides ``promptreps_stop``."""
        p = self.pieces(side, k)
        rows = [list(p.prefix) + list(t) + list(p.suffix) for t in token_ids]
        ids, att, _ = pad_rows(rows, self.bb.pad_id, "left", self.bb.device)
        bsz = len(rows)
        stop = torch.zeros(self.bb.config.vocab_size, dtype=torch.bool, device=ids.device)
        stop[[i for i in self.stop_tokens(stop_rule) if i < stop.numel()]] = True
        reference = (stop_rule or self.cfg.promptreps_stop) != "quote_in_token"
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        past = None
        cur_ids, cur_pos = ids, pos
        hs: list[torch.Tensor] = []
        lg: list[torch.Tensor] = []
        gen: list[torch.Tensor] = []
        active = torch.ones(bsz, dtype=torch.bool, device=ids.device)
        n_reps = torch.zeros(bsz, dtype=torch.long, device=ids.device)
        stopped = torch.zeros(bsz, dtype=torch.bool, device=ids.device)
        for _ in range(k):
            out = self.bb.trunk(
                input_ids=cur_ids, attention_mask=att, position_ids=cur_pos, past_key_values=past, use_cache=True
            )
            past = out.past_key_values
            h = out.last_hidden_state[:, -1]
            logits = self.bb.logits(h)
            nxt = logits.argmax(-1)
            is_stop = stop[nxt]
            # reference: the slot that predicts the stop is kept; quote_in_token: kept only if it is the first
            counts = active & (~is_stop | (n_reps == 0) | reference)
            hs.append(h)
            lg.append(logits)
            gen.append(nxt)
            n_reps += counts.long()
            stopped |= active & is_stop
            active &= ~is_stop
            if not bool(active.any()):
                break
            cur_ids = nxt[:, None]
            att = torch.cat([att, torch.ones((bsz, 1), dtype=att.dtype, device=att.device)], dim=1)
            cur_pos = cur_pos[:, -1:] + 1
        return rows, torch.stack(hs, dim=1), torch.stack(lg, dim=1), torch.stack(gen, dim=1), n_reps, stopped
