"""The :class:`Backbone`: a loaded model and tokenizer with its family's facts, the trunk split from the LM head.

The LM head is split from the trunk so that logits are computed only where they are needed
(the K mask positions), never over the whole sequence (a 152k vocabulary over every position
costs ~600 MB per batch)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import torch

from .config import BackboneConfig
from .errors import BackboneError
from .families import FAMILIES, TURN_END_CANDIDATES, mask_token_id

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Projection = tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor | None]  # Backbone.projection


class _Pretrained(Protocol):
    """What a backbone reads from a Hugging Face model beyond ``torch.nn.Module``'s own methods."""

    config: PretrainedConfig

    def get_input_embeddings(self) -> torch.nn.Module: ...

    def get_output_embeddings(self) -> torch.nn.Module | None: ...


def pretrained(model: torch.nn.Module) -> _Pretrained:
    """``model`` typed as the Hugging Face model it is (torch types ``Module.__getattr__`` as ``Tensor | Module``).

    >>> import transformers
    >>> cfg = transformers.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
    ...                               intermediate_size=8)
    >>> pretrained(transformers.BertForMaskedLM(cfg)).config.vocab_size
    50
    """
    return cast(_Pretrained, model)


def submodule(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """``module``'s child module ``name`` (torch types ``Module.__getattr__`` as ``Tensor | Module``).

    >>> submodule(torch.nn.Sequential(torch.nn.Identity()), "0")
    Identity()
    """
    return cast(torch.nn.Module, getattr(module, name))


def weight_of(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` (a linear map's or an embedding's matrix).

    >>> tuple(weight_of(torch.nn.Embedding(5, 3)).shape)
    (5, 3)
    """
    return cast(torch.Tensor, module.weight)


def softmax_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entropy (nats) and the largest probability of the softmax over the last axis of ``logits``.

    >>> h, p = softmax_stats(torch.zeros(1, 4))
    >>> round(float(h[0]), 4), float(p[0])
    (1.3863, 0.25)
    """
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1), logp.max(-1).values.exp()


class Backbone:
    """A model, its tokenizer and family facts; ``trunk`` gives hidden states, ``head`` logits from them."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        family: str,
        mask_token: str | None = None,
        turn_end: str | None = None,
        name: str = "",
        loader: Literal["native", "remote"] = "native",
    ):
        if family not in FAMILIES:
            raise BackboneError(f"unknown backbone family {family!r}; expected one of {', '.join(FAMILIES)}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.spec = FAMILIES[family]
        self.family = family
        self.loader = loader
        self.name = name or getattr(pretrained(model).config, "_name_or_path", "") or model.__class__.__name__
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._mask_token = mask_token
        self._turn_end = turn_end
        self.trunk, self.head = _split_head(model)
        self._projection: Projection | Literal[False] | None = False  # False: not looked for yet (projection())
        self.source: BackboneConfig | None = None  # the config it was loaded from (load_backbone)
        self.pad_id = _pad_id(tokenizer)
        # a causal architecture (or Dream's remote code) takes a 4D mask: every real token sees every real token
        self._causal_arch = _is_causal_arch(model)
        self._mask_4d = loader == "remote" and self.spec.remote_mask == "4d"

    # ------------------------------------------------------------------------------- tokens
    @property
    def mask_id(self) -> int:
        return mask_token_id(self.tokenizer, self.spec, self._mask_token, self.name)

    @property
    def turn_end_id(self) -> int | None:
        tok = self.tokenizer
        name = self._turn_end or self.spec.turn_end
        candidates = [name] if name else [t for t in TURN_END_CANDIDATES if t in tok.get_vocab()]
        for t in candidates:
            tid = tok.convert_tokens_to_ids(t)
            if tid is not None and tid != tok.unk_token_id:
                return int(tid)
        if name:
            raise BackboneError(f"{self.name}: end-of-turn token {name!r} is not in the vocabulary")
        return None

    @property
    def stop_ids(self) -> set[int]:
        """Special-token ids that end a readout's words (the mask excepted).

        The tokenizer's named special tokens (bos, eos, unk, sep, pad, cls, mask) and its additional special
        tokens: what ``all_special_ids`` meant in transformers 4 (5 also counts custom named tokens).
        """
        tok = self.tokenizer
        names = [
            getattr(tok, a, None)
            for a in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        ]
        extra = getattr(tok, "additional_special_tokens", None) or getattr(tok, "extra_special_tokens", None) or []
        names += list(extra.values()) if isinstance(extra, dict) else list(extra)
        ids = {tok.convert_tokens_to_ids(str(t)) for t in names if t}
        out = {int(i) for i in ids if i is not None and i != tok.unk_token_id}
        try:
            out.discard(self.mask_id)
        except BackboneError:  # no mask token: nothing to except
            pass
        return out

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def config(self) -> PretrainedConfig:
        """The model's Hugging Face config."""
        return pretrained(self.model).config

    @property
    def hidden_size(self) -> int:
        cfg = self.config
        return int(getattr(cfg, "hidden_size", None) or cfg.d_model)

    @property
    def vocab_size(self) -> int:
        """The LM head's output size (logits per position)."""
        out = pretrained(self.model).get_output_embeddings()
        return int(weight_of(out).shape[0]) if out is not None else int(self.config.vocab_size)

    def input_embeddings(self) -> torch.Tensor:
        """The input embedding matrix [V, H]."""
        return weight_of(pretrained(self.model).get_input_embeddings())

    # ------------------------------------------------------------------------------ forward
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        """Last hidden states [B, L, H]; ``bidirectional`` forces full attention on causal architectures."""
        kwargs: dict[str, Any] = {}
        mask: torch.Tensor = attention_mask
        back: torch.Tensor | None = None
        if bidirectional and self._causal_arch:
            mask = bidirectional_mask(attention_mask, self.dtype)
            # positions count real tokens only, so left padding does not shift them
            kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        else:
            # the model numbers positions from the first column (absolute position embeddings: BERT), so left
            # padding would shift them: run left-padded rows rotated to right padding and rotate the states back
            width = input_ids.shape[1]
            lead = (attention_mask.cumsum(-1) == 0).sum(-1, keepdim=True) % width  # [B, 1] leading pads
            if input_ids.is_cuda or bool(lead.any()):  # a GPU rotates without asking (no read back; 0 is identity)
                cols = torch.arange(width, device=input_ids.device)[None, :]
                fwd, back = (cols + lead) % width, (cols - lead) % width
                input_ids, mask = input_ids.gather(1, fwd), attention_mask.gather(1, fwd)
        if self._mask_4d and mask.dim() == 2:
            mask = bidirectional_mask(mask, self.dtype)
        out = self.trunk(input_ids=input_ids, attention_mask=mask, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        if back is not None:
            hidden = hidden.gather(1, back[..., None].expand(-1, -1, hidden.shape[-1]))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def read_head(self, hidden: torch.Tensor, columns: torch.Tensor, stats: bool = False) -> tuple[torch.Tensor, ...]:
        """What a readout takes from the LM head at ``hidden`` [..., H]: the argmax token over the vocabulary
        [...] and the float32 logits at ``columns`` [C] ([..., C]), equal to those of :meth:`logits`; with
        ``stats``, also the entropy (nats) and the maximum probability of the softmax over the vocabulary [...]
        (a running log-sum-exp over the blocks; the query features of adaptive budgets).

        On a CPU the vocabulary is projected a block at a time (``VOCAB_BLOCK_BYTES`` of logits, which stay in
        the cache) with a running maximum, so the [..., V] logits are never held: the matrix product of each
        block is the same product as the whole head's (a test checks the values bit for bit). A head that is not
        a transform followed by one linear map (or a GPU) takes the full head.

        >>> import transformers
        >>> cfg = transformers.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
        ...                               intermediate_size=8)
        >>> tok = SimpleNamespace(pad_token_id=0, eos_token_id=None, unk_token_id=None)
        >>> bb = Backbone(transformers.BertForMaskedLM(cfg), tok, "mlm")
        >>> h = torch.randn(2, 3, 8)
        >>> top, at = bb.read_head(h, torch.tensor([4, 7]))
        >>> bool((top == bb.logits(h).argmax(-1)).all()), bool(torch.equal(at, bb.logits(h)[..., [4, 7]]))
        (True, True)
        """
        proj = self.projection() if hidden.device.type == "cpu" else None
        if proj is None:  # the argmax and the columns read in the head's own dtype (exact), only they cast
            full = self.logits(hidden)
            picked = full[..., columns.to(full.device)].float()
            if not stats:
                return full.argmax(-1), picked
            return full.argmax(-1), picked, *softmax_stats(full)
        pre, weight, bias = proj
        x = pre(hidden)
        flat = x.reshape(-1, x.shape[-1])
        vocab = weight.shape[0]
        block = max(32, VOCAB_BLOCK_BYTES // (4 * max(1, flat.shape[0])))
        best = torch.full((flat.shape[0],), float("-inf"), device=x.device)
        top = torch.zeros(flat.shape[0], dtype=torch.long, device=x.device)
        columns = columns.to(x.device)
        picked = torch.empty((flat.shape[0], columns.numel()), dtype=torch.float32, device=x.device)
        sorted_cols, order = torch.sort(columns)
        # with stats: sum exp(l - best) and sum exp(l - best) * l over the blocks so far, rescaled as best grows
        s0 = torch.zeros(flat.shape[0], dtype=torch.float64, device=x.device) if stats else None
        s1 = None if s0 is None else torch.zeros_like(s0)
        for s in range(0, vocab, block):
            e = min(vocab, s + block)
            lg = torch.nn.functional.linear(flat, weight[s:e], None if bias is None else bias[s:e]).float()
            m, i = lg.max(-1)
            better = m > best  # strictly: the first of equal maxima wins, as argmax's
            if s0 is not None and s1 is not None:  # with stats
                new_best = torch.maximum(m, best).double()
                scale = torch.exp(best.double() - new_best)
                w = torch.exp(lg.double() - new_best[:, None])
                s0 = s0 * scale + w.sum(-1)
                s1 = s1 * scale + (w * lg.double()).sum(-1)
            best = torch.where(better, m, best)
            top = torch.where(better, i + s, top)
            lo, hi = torch.searchsorted(sorted_cols, torch.tensor([s, e], device=x.device)).tolist()
            if hi > lo:
                picked[:, order[lo:hi]] = lg[:, sorted_cols[lo:hi] - s]
        lead = x.shape[:-1]
        if s0 is None or s1 is None:  # without stats
            return top.reshape(lead), picked.reshape(*lead, columns.numel())
        lse = best.double() + torch.log(s0)  # log of the softmax's normaliser
        entropy = (lse - s1 / s0).float()  # H = lse - E[l]
        maxprob = torch.exp(best.double() - lse).float()
        return top.reshape(lead), picked.reshape(*lead, columns.numel()), entropy.reshape(lead), maxprob.reshape(lead)

    def projection(self) -> Projection | None:
        """(transform, weight [V, H], bias) with ``logits(h) == linear(transform(h), weight, bias)`` bit for bit
        (checked once on random states), or None when the head is not of that shape (a wrapped or custom head)."""
        if self._projection is False:
            self._projection = _find_projection(self)
        return self._projection

    def rebind_head(self) -> None:
        """Bind the trunk and head again from the model (after peft wrapped some of its modules in place)."""
        self.trunk, self.head = _split_head(self.model)
        self._projection = False


def bidirectional_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, L] padding mask -> [B, 1, L, L] additive mask: every query sees every real key."""
    keys = attention_mask[:, None, None, :].to(torch.bool)
    full = keys.expand(-1, 1, attention_mask.shape[1], -1)
    out = torch.zeros(full.shape, dtype=dtype, device=attention_mask.device)
    return out.masked_fill(~full, torch.finfo(dtype).min)


def _is_causal_arch(model: torch.nn.Module) -> bool:
    cfg = pretrained(model).config
    return (
        bool(getattr(cfg, "is_decoder", False))
        or any(a.endswith("ForCausalLM") for a in (getattr(cfg, "architectures", None) or [model.__class__.__name__]))
        or model.__class__.__name__.endswith("ForCausalLM")
    )


def _pad_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if tid is not None:
            return int(tid)
    return 0


def _split_head(model: torch.nn.Module) -> tuple[Callable[..., Any], Callable[[torch.Tensor], torch.Tensor]]:
    """(trunk, head) such that head(trunk(x).last_hidden_state) == model(x).logits."""
    name = model.__class__.__name__
    if hasattr(model, "cls") and hasattr(model, "bert"):  # BertForMaskedLM and relatives
        return submodule(model, "bert"), submodule(model, "cls")
    if hasattr(model, "head") and hasattr(model, "decoder") and hasattr(model, "model"):  # ModernBertForMaskedLM
        return submodule(model, "model"), lambda h: submodule(model, "decoder")(submodule(model, "head")(h))
    if hasattr(model, "lm_head") and hasattr(model, "model"):  # Llama, Qwen2, Dream, ...
        return submodule(model, "model"), submodule(model, "lm_head")
    transformer = getattr(getattr(model, "model", None), "transformer", None)
    if transformer is not None and "ln_f" in transformer and "blocks" in transformer:  # LLaDA's own code
        return _llada_trunk(submodule(model, "model")), _llada_head(submodule(model, "model"))
    for prefix, head_name in (("roberta", "lm_head"), ("distilbert", "vocab_projector")):
        if hasattr(model, prefix) and hasattr(model, head_name):
            if prefix == "distilbert":
                return submodule(model, "distilbert"), lambda h: submodule(model, "vocab_projector")(
                    submodule(model, "vocab_layer_norm")(
                        submodule(model, "activation")(submodule(model, "vocab_transform")(h))
                    )
                )
            return submodule(model, prefix), submodule(model, head_name)
    raise BackboneError(
        f"{name}: do not know how to apply its LM head to selected positions only; "
        "add the family to retrieval.models.backbones.backbone._split_head"
    )


VOCAB_BLOCK_BYTES = 4 << 20  # float32 logits of one vocabulary block (read_head on a CPU): about a core's L2


def _find_projection(
    bb: Backbone,
) -> Projection | None:
    """The head as a transform and one linear map (Backbone.projection): a decoder after BERT's prediction
    transform or ModernBERT's head, an lm_head (LLaDA's ff_out) alone, or LLaDA's tied input embeddings."""
    head, model = bb.head, bb.model
    candidates: list[Projection] = []
    if type(head) is torch.nn.Linear:
        candidates.append((lambda h: h, head.weight, head.bias))
    predictions = getattr(head, "predictions", None)  # BERT's MLM head: transform, then decoder
    decoder = getattr(predictions, "decoder", None)
    if type(decoder) is torch.nn.Linear and predictions is not None:
        candidates.append((predictions.transform, decoder.weight, decoder.bias))
    decoder = getattr(model, "decoder", None)  # ModernBERT's: head, then decoder
    if type(decoder) is torch.nn.Linear and isinstance(getattr(model, "head", None), torch.nn.Module):
        candidates.append((submodule(model, "head"), decoder.weight, decoder.bias))
    transformer = getattr(getattr(model, "model", None), "transformer", None)
    if transformer is not None and "wte" in transformer and "ff_out" not in transformer:
        candidates.append((lambda h: h, transformer["wte"].weight, None))
    if not candidates:
        return None
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn((3, 2, bb.hidden_size), generator=gen).to(device=bb.device, dtype=bb.dtype)
    with torch.inference_mode():
        want = bb.logits(probe)
        for pre, weight, bias in candidates:
            if weight.shape[0] != want.shape[-1]:
                continue
            got = torch.cat(
                [
                    torch.nn.functional.linear(
                        pre(probe), weight[s : s + 1000], None if bias is None else bias[s : s + 1000]
                    )
                    for s in range(0, weight.shape[0], 1000)
                ],
                -1,
            )
            if torch.equal(got, want):
                return pre, weight, bias
    return None


def _llada_trunk(llada: torch.nn.Module) -> Callable[..., Any]:
    """LLaDA's own model without its output projection: its "logits" are the final hidden states."""
    trunk = copy.copy(llada)
    trunk._modules = dict(llada._modules)
    transformer = torch.nn.ModuleDict(dict(_llada_blocks(llada).items()))
    if "ff_out" in transformer:
        transformer["ff_out"] = torch.nn.Identity()
    trunk._modules["transformer"] = transformer
    tied = bool(getattr(pretrained(llada).config, "weight_tying", False))

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> Any:
        out = trunk(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=tied)
        return SimpleNamespace(last_hidden_state=out.hidden_states[-1] if tied else out.logits)

    return forward


def _llada_head(llada: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    t = _llada_blocks(llada)
    if "ff_out" in t:
        return t["ff_out"]
    return lambda h: torch.nn.functional.linear(h, weight_of(t["wte"]))


def _llada_blocks(llada: torch.nn.Module) -> torch.nn.ModuleDict:
    """LLaDA's own ``transformer``: a ModuleDict of its embeddings, blocks, final norm and output projection."""
    return cast(torch.nn.ModuleDict, llada.transformer)
