"""Encoding throughput, in one process on the same texts and batch size:

1. the pipeline's encode (length-sorted batches, the LM head read a vocabulary block at a time at the K masks,
   the content filter's ids read as the tokenize stage stores them) vs bare HF loops over the same inputs:
   ``model(**batch)`` with full logits; the trunk only (forward + gather at the masks)         target >= 0.90x;
   the trunk and the LM head at the masks (the least the reference readout reads: every slot's argmax)
2. length-sorted vs unsorted batching (the same pipeline code)                              target >= 1.2x
3. passage encode time at K = 16 over K = 1 (the paper's near-constant-in-K claim)            target <= 1.2
4. the content filter, once per text at tokenize time, against filtering in every K pass (what encode did before
   tokenize stored it), and against the encode time

``--readout sidr``: SIDR's readout (the head at every position of a text, max-pooled) through the pipeline, against
the per-text head product it replaced, on the same batches (the same vectors, byte for byte), and against the
mask readout at K = 1 on the same model                                                      target >= 5x per-text

    python benchmarks/encode.py [--model ../shared/models/splade-tiny-mlm] [--docs 1000] [--device auto]
    python benchmarks/encode.py --readout sidr --docs 300
    python benchmarks/encode.py --model ../shared/models/tiny-dream-random --load-format random --shape dream-7b \
        --device cuda --dtype bfloat16     # a Dream-7B-shaped network of random weights (a GPU; no download)
    python benchmarks/encode.py --model ../shared/models/smollm2-135m-instruct-gguf --skip full,in-encode \
        --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --mask-token '<|im_start|>' --docs 96 --batch-size 16 \
        --max-length 512        # the model's compute dominates (a causal LM read through masks, bidirectionally)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from diffret.retrieval.models.backbones import BackboneConfig, bidirectional_mask, load_backbone
from diffret.retrieval.models.encoding import encode_rows
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader
from diffret.stages.readers import passage_text

REPO = Path(__file__).resolve().parents[1]


def load_texts(path: Path, n: int) -> list[str]:
    out = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            out.append(passage_text(d.get("title", ""), d["text"]))
            if len(out) >= n:
                break
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "splade-tiny-mlm"))
    ap.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "scifact" / "corpus.jsonl"))
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--mask-token", default=None, help="for a model without one (a causal LM read through masks)")
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated rows to leave out: full (the full-logits loop), in-encode (filtering while encoding)",
    )
    ap.add_argument("--readout", default="diffretriever", choices=["diffretriever", "sidr"])
    ap.add_argument(
        "--load-format",
        default="checkpoint",
        choices=["checkpoint", "random"],
        help="random: the network of --model's config (or --shape) with random weights, no weight file",
    )
    ap.add_argument("--shape", default=None, help="with --load-format random: dream-7b, llada-8b (NAME:key=value,...)")
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()
    if args.readout == "sidr":
        return sidr(args)

    bb = load_backbone(
        BackboneConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            gguf_file=args.gguf_file,
            mask_token=args.mask_token,
            load_format=args.load_format,
            shape=args.shape,
        )
    )
    reader = make_reader(bb, ReadoutConfig(padding_side="right"), args.max_length)
    tok = bb.tokenizer
    texts = load_texts(Path(args.corpus), args.docs)
    ids = [str(i) for i in range(len(texts))]
    token_ids = [t[: args.max_length] for t in tok(texts, add_special_tokens=False)["input_ids"]]
    print(
        f"model {args.model} on {bb.device} ({args.dtype}); {len(texts)} passages, batch {args.batch_size}, "
        f"max length {args.max_length}"
    )

    flt = reader.filter
    filtered: list[list[int]] | None = None

    def stored_filter() -> None:  # what the tokenize stage computes once per text (a fresh word cache)
        nonlocal filtered
        if flt is not None:
            flt._cache.clear()
            filtered = flt.allowed_many(texts)

    def pipeline(k: int, sort: bool = True, filter_in_encode: bool = False):
        return lambda: encode_rows(
            reader,
            ids,
            token_ids,
            texts,
            side="passage",
            k=k,
            batch_size=args.batch_size,
            sort_by_length=sort,
            filtered=None if filter_in_encode else filtered,
        )

    # the bare loop: the same input sequences (prompt + text + K masks + closing), in file order
    k = args.k
    p = reader.pieces("passage", k)
    mask = bb.mask_id
    fitted = reader._fit(token_ids, "passage", k)
    rows = [list(p.prefix) + t + list(p.suffix) + [mask] * k + list(p.closing) for t in fitted]

    def inputs(batch: list[list[int]]) -> dict:
        enc = dict(tok.pad({"input_ids": batch}, return_tensors="pt", padding=True).to(bb.device))
        if not bb.spec.bidirectional:  # a causal LM read through masks: every token sees every token, as encode's
            att = enc["attention_mask"]
            enc["position_ids"] = (att.cumsum(-1) - 1).clamp(min=0)
            enc["attention_mask"] = bidirectional_mask(att, bb.dtype)
        return enc

    @torch.inference_mode()
    def bare(what: str):
        """full: model(**batch) with every position's logits; trunk: the trunk, gathered at the masks; head: and
        the LM head at the masks (argmax)."""
        out = []
        for s in range(0, len(rows), args.batch_size):
            enc = inputs(rows[s : s + args.batch_size])
            is_mask = enc["input_ids"] == mask
            if what == "full":
                res = bb.model(**enc, output_hidden_states=True)
                out.append((res.hidden_states[-1][is_mask].half().cpu(), res.logits[is_mask].float().cpu()))
                continue
            h = bb.model.base_model(**enc).last_hidden_state[is_mask]
            out.append((h.half().cpu(), bb.logits(h).float().argmax(-1).cpu() if what == "head" else None))
        return out

    skip = set(args.skip.split(",")) if args.skip else set()
    n = len(texts)
    if flt is not None:
        flt.allowed_many(texts[:1])  # NLTK loads its data once per process, outside the timing
    t_filter = timed(stored_filter, bb.device, 1)
    pipeline(1)()  # warm up
    t_pipe = timed(pipeline(k), bb.device, args.repeats)
    rows_out = [(f"pipeline K={k}", t_pipe, "")]
    if "full" not in skip:
        t_bare = timed(lambda: bare("full"), bb.device, args.repeats)
        rows_out.append(("bare HF loop, full logits", t_bare, f"pipeline/bare {t_bare / t_pipe:.2f}x"))
    t_trunk = timed(lambda: bare("trunk"), bb.device, args.repeats)
    t_head = timed(lambda: bare("head"), bb.device, args.repeats)
    t_unsorted = timed(pipeline(k, sort=False), bb.device, args.repeats)
    t_k1 = timed(pipeline(1), bb.device, args.repeats)
    rows_out += [
        ("bare HF loop, trunk only", t_trunk, f"pipeline/bare {t_trunk / t_pipe:.2f}x (target >= 0.90)"),
        ("bare loop, trunk + head@K", t_head, f"pipeline/bare {t_head / t_pipe:.2f}x"),
        ("unsorted batches", t_unsorted, f"sorted/unsorted {t_unsorted / t_pipe:.2f}x (target >= 1.2)"),
        ("pipeline K=1", t_k1, f"time K={k} / K=1 {t_pipe / t_k1:.2f} (target <= 1.2)"),
    ]
    if "in-encode" not in skip:
        t_in_encode = timed(pipeline(k, filter_in_encode=True), bb.device, args.repeats)
        rows_out += [
            ("filter while encoding", t_in_encode, f"stored filter {t_in_encode / t_pipe:.2f}x faster"),
            (
                "filter at tokenize, once",
                t_filter,
                f"{t_filter / t_pipe:.2f} of one K pass's encode time; saved per K pass: {t_in_encode - t_pipe:.2f} s",
            ),
        ]
    for name, t, note in rows_out:
        print(f"{name:28s} {n / t:9.2f} docs/s  {note}")


def sidr(args: argparse.Namespace) -> None:
    """SIDR's readout: the pipeline (one head product per batch, padding left out) against the per-text product it
    replaced (the code before: ``weights`` one text at a time, kept here as the baseline), on the same batches; the
    vectors compared byte for byte."""
    bb = load_backbone(
        BackboneConfig(
            model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format, shape=args.shape
        )
    )
    reader = make_reader(bb, ReadoutConfig(readout="sidr"), args.max_length)
    texts = load_texts(Path(args.corpus), args.docs)
    ids = [str(i) for i in range(len(texts))]
    token_ids = [t[: args.max_length] for t in bb.tokenizer(texts, add_special_tokens=False)["input_ids"]]
    print(
        f"model {args.model} on {bb.device} ({args.dtype}), {torch.get_num_threads()} threads; {len(texts)} "
        f"passages, batch {args.batch_size}, max length {args.max_length}; readout sidr"
    )
    batched = reader.batch_weights

    def per_text(hidden: torch.Tensor, att: torch.Tensor, side_bb=None) -> torch.Tensor:  # noqa: ANN001
        return torch.stack([reader.weights(hidden[i][att[i].bool()], side_bb) for i in range(len(hidden))])

    def encode(weights, readout=None):  # noqa: ANN001, ANN202
        reader.batch_weights = weights
        try:
            return encode_rows(
                readout or reader, ids, token_ids, texts, side="passage", k=1, batch_size=args.batch_size
            )
        finally:
            reader.batch_weights = batched

    encode(batched)  # warm up
    t_new = timed(lambda: encode(batched), bb.device, args.repeats)
    t_old = timed(lambda: encode(per_text), bb.device, args.repeats)
    same = encode(batched).equals(encode(per_text))
    width = len(bb.tokenizer)

    def no_head(hidden: torch.Tensor, att: torch.Tensor, side_bb=None) -> torch.Tensor:  # noqa: ANN001
        return torch.ones((len(hidden), width), device=hidden.device)  # every cost but the head's: any head's ceiling

    t_trunk = timed(lambda: encode(no_head), bb.device, args.repeats)
    mask = make_reader(bb, ReadoutConfig(padding_side="right"), args.max_length)
    t_mask = timed(lambda: encode(batched, mask), bb.device, args.repeats)
    n = len(texts)
    for name, t, note in [
        ("sidr, per batch (pipeline)", t_new, f"{t_old / t_new:.2f}x per text (target >= 5)"),
        ("sidr, per text (before)", t_old, ""),
        ("sidr without its head", t_trunk, f"{t_old / t_trunk:.2f}x per text: the ceiling of any head"),
        ("mask readout K=1", t_mask, f"mask/sidr {t_new / t_mask:.2f}x"),
    ]:
        print(f"{name:28s} {n / t:9.2f} docs/s  {note}")
    print(f"the same vectors, byte for byte: {same}")


if __name__ == "__main__":
    main()
