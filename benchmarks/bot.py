"""SIDR's bag-of-tokens index against BM25's, and its bytes against dense encodings.

For each BEIR folder, in this process: BM25's index build (bm25s: its tokenizer + index, as `diffret bm25`
builds it), the BoT from raw text (the model's tokenizer, then the bags), and the BoT from stored token ids (the
`bot` stage's work: bags only); then the BoT's zstd Parquet bytes against fp16 dense encodings of the same corpus
(splade-tiny's H = 128 at K_p = 1; Dream-7B's H = 3584 at K_p = 1 and 16), and MS MARCO (8,841,823 passages)
projected from the measured per-token rates (its mean passage length is taken as 75 wordpieces: 56 words).

    python benchmarks/bot.py [MODEL] [BEIR_FOLDER ...]   (default: ../shared/models/splade-tiny-mlm, scifact, nfcorpus)
"""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffret.retrieval.models.encoding import tokenize_texts  # noqa: E402
from diffret.retrieval.models.sparse import excluded_ids  # noqa: E402
from diffret.retrieval.search.bm25 import BM25Settings, _tokenize  # noqa: E402
from diffret.retrieval.search.bot import bag_of_tokens  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
MSMARCO_PASSAGES, MSMARCO_TOKENS = 8_841_823, 75


def texts(folder: Path) -> tuple[list[str], list[str]]:
    ids, out = [], []
    with open(folder / "corpus.jsonl") as fh:
        for line in fh:
            d = json.loads(line)
            ids.append(str(d["_id"]))
            out.append((d.get("title") or "") + ". " + (d.get("text") or ""))
    return ids, out


def timed(fn):  # the best of three: the machine's noise, not the method's
    best, out = float("inf"), None
    for _ in range(3):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(model: str, folders: list[Path]) -> None:
    import bm25s
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    banned = sorted(excluded_ids(tok))
    for folder in folders:
        ids, docs = texts(folder)

        def bm25_index(docs: list[str] = docs) -> object:
            r = bm25s.BM25(method="lucene", k1=0.9, b=0.4)
            r.index(_tokenize(docs, BM25Settings()), show_progress=False)
            return r

        def tokens(docs: list[str] = docs) -> pa.ChunkedArray:
            return tokenize_texts(tok, docs, 256).column("token_ids")

        t_bm25, _ = timed(bm25_index)
        t_tok, token_ids = timed(tokens)
        t_bags, bags = timed(lambda token_ids=token_ids: bag_of_tokens(token_ids, banned))
        buf = io.BytesIO()
        pq.write_table(pa.table({"id": ids, "token_ids": bags}), buf, compression="zstd")
        size = len(buf.getvalue())
        n, n_tok = len(docs), sum(len(x) for x in token_ids.to_pylist())
        print(f"{folder.name}: {n:,} passages, {n_tok / n:.0f} tokens and {len(bags.values) / n:.0f} distinct each")
        print(f"  BM25 index build      {t_bm25:7.2f} s   1.00x")
        print(f"  BoT from raw text     {t_tok + t_bags:7.2f} s   {(t_tok + t_bags) / t_bm25:.2f}x of BM25")
        print(f"  BoT from stored ids   {t_bags:7.2f} s   {t_bags / t_bm25:.3f}x of BM25 (the bot stage's work)")
        for name, h, k in (
            ("splade-tiny H=128, K_p=1", 128, 1),
            ("Dream-7B H=3584, K_p=1", 3584, 1),
            ("Dream-7B H=3584, K_p=16", 3584, 16),
        ):
            dense = n * h * k * 2
            print(f"  BoT {size / 1e6:7.2f} MB vs fp16 dense {name}: {dense / 1e6:9.2f} MB ({size / dense:.4f}x)")
        per_tok_s = (t_tok + t_bags) / n_tok
        per_tok_b = size / n_tok
        m_tok = MSMARCO_PASSAGES * MSMARCO_TOKENS
        print(
            f"  MS MARCO projected: BoT {m_tok * per_tok_b / 1e9:.2f} GB, built in {m_tok * per_tok_s / 60:.1f} "
            f"CPU-min from raw text; fp16 Dream-7B K_p=16: {MSMARCO_PASSAGES * 3584 * 16 * 2 / 1e12:.2f} TB"
        )


if __name__ == "__main__":
    args = sys.argv[1:]
    model = args[0] if args else str(SHARED / "models" / "splade-tiny-mlm")
    folders = [Path(a) for a in args[1:]] or [SHARED / "data" / "scifact", SHARED / "data" / "nfcorpus"]
    main(model, folders)
