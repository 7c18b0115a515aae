from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
NLTK_DATA = Path(__file__).resolve().parent / "unit" / "data" / "nltk_data"  # a copy of ../shared/nltk_data
# The reference content filter reads NLTK's English data; tests (and the CLI subprocesses they start) find the
# vendored copy first and never try NLTK's downloader.
os.environ["NLTK_DATA"] = os.pathsep.join(p for p in (str(NLTK_DATA), os.environ.get("NLTK_DATA")) if p)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several threads spin badly when the CPUs are shared (10x slower).
    A module uses it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def shared_data() -> Path:
    """../shared/data beside the checkout; tests that need it skip cleanly when it is absent."""
    data = SHARED / "data"
    if not (data / "scifact" / "corpus.jsonl").exists():
        pytest.skip("../shared/data is not beside this checkout")
    return data


def write_beir(folder: Path, corpus: list[dict] | None, queries: list[dict], qrels: dict[str, list[tuple]]) -> Path:
    """A tiny collection in BEIR layout (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)."""
    folder.mkdir(parents=True, exist_ok=True)
    if corpus is not None:
        (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus))
    (folder / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (folder / "qrels").mkdir(exist_ok=True)
    for split, rows in qrels.items():
        body = "".join(f"{q}\t{d}\t{r}\n" for q, d, r in rows)
        (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + body)
    return folder


@pytest.fixture
def tiny_beir(tmp_path: Path) -> Path:
    corpus = [
        {"_id": "d1", "title": "Cats", "text": "cats purr"},
        {"_id": "d2", "title": "", "text": "dogs bark", "metadata": {"year": 2020}},
        {"_id": "d3", "title": "Empty", "text": ""},
    ]
    queries = [
        {"_id": "q1", "text": "what do cats do"},
        {"_id": "q2", "text": "barking"},
        {"_id": "q3", "text": "never judged"},
    ]
    qrels = {"test": [("q1", "d1", 1), ("q2", "d2", 2)], "train": [("q2", "d1", 0)]}
    return write_beir(tmp_path / "tiny", corpus, queries, qrels)
