"""The DiffuRank efficiency argument, measured: on the same backbone, the same windows and the same hardware,

1. logits_listwise: one bidirectional forward pass per window of N documents (N masked answers read at once),
2. pointwise: N (query, document) prompts per window, batched into one pass,
3. permutation_assignment: one pass per window, the permutation solved from it,
against an autoregressive listwise reranker (RankGPT style) that generates the window's permutation token by
token with the KV cache (greedy, "A\\nC\\nB..." = 2N new tokens after one prefill). Printed: seconds per window
and each method's speed-up over the autoregressive one (a ratio: both run here, in this process).

    python benchmarks/rerank.py [--model ../shared/models/smollm2-135m-instruct-gguf --gguf-file ...]
        [--mask-token "<empty_output>"] [--window 20] [--doc-tokens 64] [--windows 6] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from diffret.retrieval.models.backbones import BackboneConfig, load_backbone
from diffret.retrieval.rerank.rerankers import make_reranker

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def scifact_windows(n_windows: int, window: int) -> list[tuple[str, list[str]]]:
    """SciFact test queries, each with ``window`` passages (its judged ones first, then the corpus in order)."""
    corpus = [json.loads(x) for x in (SHARED / "data/scifact/corpus.jsonl").read_text().splitlines() if x.strip()]
    queries = [json.loads(x) for x in (SHARED / "data/scifact/queries.jsonl").read_text().splitlines() if x.strip()]
    texts = [d["title"] + ". " + d["text"] for d in corpus]
    return [(q["text"], texts[i * window : (i + 1) * window]) for i, q in enumerate(queries[:n_windows])]


def timed(fn, repeat: int) -> float:
    """The median wall time of ``fn()`` over ``repeat`` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(SHARED / "models/smollm2-135m-instruct-gguf"))
    ap.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--mask-token", default="<empty_output>", help="a causal LM's stand-in mask (SmolLM2)")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--doc-tokens", type=int, default=64)
    ap.add_argument("--windows", type=int, default=6, help="windows (one query each) timed per method")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    gguf = args.gguf_file if args.model.rstrip("/").endswith("gguf") else None
    cfg = BackboneConfig(model=args.model, gguf_file=gguf, mask_token=args.mask_token or None, device=args.device)
    bb = load_backbone(cfg)
    windows = scifact_windows(args.windows, args.window)
    common = dict(window=args.window, step=args.window, doc_tokens=args.doc_tokens, batch_size=args.window)
    listwise = make_reranker("logits_listwise", bb, **common)
    assign = make_reranker("permutation_assignment", bb, **common)
    point = make_reranker("pointwise", bb, **common)
    items_point = [(q, [(str(i), d) for i, d in enumerate(docs)]) for q, docs in windows]

    # the autoregressive reranker: the permutation prompt without masks, greedy decoding of 2N tokens
    prompts = []
    for q, docs in windows:
        enc = assign.builder.listwise(q, docs, assign.window_ids(len(docs)))
        prompts.append(enc.ids[: enc.slots[0]])  # everything before the first rank slot
    n_new = 2 * args.window  # "A\n" per document

    def autoregressive() -> None:
        for ids in prompts:
            x = torch.tensor([ids], device=bb.device)
            with torch.no_grad():
                bb.model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=n_new,
                    min_new_tokens=n_new,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=bb.pad_id,
                )

    results = {
        "autoregressive (generate 2N tokens, KV cache)": timed(autoregressive, args.repeat),
        "logits_listwise (1 pass per window)": timed(lambda: listwise.rank_windows(windows), args.repeat),
        "permutation_assignment (1 pass per window)": timed(lambda: assign.rank_windows(windows), args.repeat),
        "pointwise (N prompts per window, batched)": timed(lambda: point.rerank(items_point), args.repeat),
    }
    base = results["autoregressive (generate 2N tokens, KV cache)"]
    print(
        f"model {args.model} on {bb.device}, window {args.window}, {args.doc_tokens} tokens per document, "
        f"{len(windows)} windows, median of {args.repeat}; prompt {statistics.mean(map(len, prompts)):.0f} tokens"
    )
    for name, t in results.items():
        print(f"  {name:48s} {t / len(windows) * 1000:9.1f} ms per window   {base / t:5.2f}x vs autoregressive")


if __name__ == "__main__":
    main()
