"""Encoding throughput, in one process on the same texts and batch size:

1. the pipeline's encode (length-sorted batches, LM head at the K masks only, the content filter's ids read as
   the tokenize stage stores them) vs a bare HF loop (the same prompt + K masks, ``model(**batch,
   output_hidden_states=True)``, full logits; and the trunk only)                           target >= 0.90x
2. length-sorted vs unsorted batching (the same pipeline code)                              target >= 1.2x
3. passage encode time at K = 16 over K = 1 (the paper's near-constant-in-K claim)            target <= 1.2
4. the content filter, once per text at tokenize time, against filtering in every K pass (what encode did before
   tokenize stored it), and against the encode time

    python benchmarks/encode.py [--model ../shared/models/splade-tiny-mlm] [--docs 1000] [--device auto]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from retrieval.models.backbones import BackboneConfig, load_backbone
from retrieval.models.encoding import encode_rows
from retrieval.models.readouts import ReadoutConfig, make_reader
from stages.readers import passage_text

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
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()

    bb = load_backbone(BackboneConfig(model=args.model, device=args.device, dtype=args.dtype))
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
        flt._cache.clear()
        filtered = flt.allowed_many(texts) if flt is not None else None

    def pipeline(k: int, sort: bool = True, filter_in_encode: bool = False):
        return lambda: encode_rows(reader, ids, token_ids, texts, "passage", k, args.batch_size, sort_by_length=sort,
                                   filtered=None if filter_in_encode else filtered)  # fmt: skip

    # the bare loop: the same input sequences (prompt + text + K masks + closing), in file order
    k = args.k
    p = reader.pieces("passage", k)
    mask = bb.mask_id
    fitted = reader._fit(token_ids, "passage", k)
    rows = [list(p.prefix) + t + list(p.suffix) + [mask] * k + list(p.closing) for t in fitted]

    @torch.inference_mode()
    def bare():
        out = []
        for s in range(0, len(rows), args.batch_size):
            batch = rows[s : s + args.batch_size]
            enc = tok.pad({"input_ids": batch}, return_tensors="pt", padding=True).to(bb.device)
            res = bb.model(**enc, output_hidden_states=True)
            h = res.hidden_states[-1]
            is_mask = enc["input_ids"] == mask
            out.append((h[is_mask].half().cpu(), res.logits[is_mask].float().cpu()))
        return out

    @torch.inference_mode()
    def bare_trunk():
        out = []
        for s in range(0, len(rows), args.batch_size):
            batch = rows[s : s + args.batch_size]
            enc = tok.pad({"input_ids": batch}, return_tensors="pt", padding=True).to(bb.device)
            h = bb.model.base_model(**enc).last_hidden_state
            out.append(h[enc["input_ids"] == mask].half().cpu())
        return out

    t_filter = timed(stored_filter, bb.device, 1)
    pipeline(1)()  # warm up
    t_pipe = timed(pipeline(k), bb.device, args.repeats)
    t_in_encode = timed(pipeline(k, filter_in_encode=True), bb.device, args.repeats)
    t_bare = timed(bare, bb.device, args.repeats)
    t_trunk = timed(bare_trunk, bb.device, args.repeats)
    t_unsorted = timed(pipeline(k, sort=False), bb.device, args.repeats)
    t_k1 = timed(pipeline(1), bb.device, args.repeats)
    n = len(texts)
    rows_out = [
        (f"pipeline K={k}", t_pipe, ""),
        ("bare HF loop, full logits", t_bare, f"pipeline/bare {t_bare / t_pipe:.2f}x (target >= 0.95)"),
        ("bare HF loop, trunk only", t_trunk, f"pipeline/bare {t_trunk / t_pipe:.2f}x (target >= 0.95)"),
        ("unsorted batches", t_unsorted, f"sorted/unsorted {t_unsorted / t_pipe:.2f}x (target >= 1.2)"),
        ("pipeline K=1", t_k1, f"time K={k} / K=1 {t_pipe / t_k1:.2f} (target <= 1.2)"),
        ("filter while encoding", t_in_encode, f"stored filter {t_in_encode / t_pipe:.2f}x faster"),
        ("filter at tokenize, once", t_filter, f"{t_filter / t_pipe:.2f} of one K pass's encode time; saved per "
         f"K pass: {t_in_encode - t_pipe:.2f} s"),
    ]
    for name, t, note in rows_out:
        print(f"{name:28s} {n / t:9.1f} docs/s  {note}")


if __name__ == "__main__":
    main()
