"""The mask readout reads nothing back from the device while it queues a batch: every value the host needs (the dense
vectors, the kept slots, the tokens read, the sparse vectors, the head's statistics) comes back in one copy per batch,
when the batch's result is asked for. On a CPU the reads that would wait for a GPU are counted (the tensor methods that
bring values to the host and the operators whose output size depends on the data); on a GPU, torch's own
synchronisation check counts them (skipped without one)."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch
from tiny_models import TEXTS, tiny_backbone
from torch.utils._python_dispatch import TorchDispatchMode

from diffret.retrieval.models.encoding import encode_rows
from diffret.retrieval.models.readouts import ReadoutConfig, make_reader

pytestmark = pytest.mark.usefixtures("one_thread")

READS = ("tolist", "numpy", "item", "cpu", "__bool__", "__int__", "__float__", "__index__")
# operators that wait for a GPU: a scalar read back, an output whose size depends on the values
WAITING_OPS = (
    "_local_scalar_dense",
    "nonzero",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "masked_select",
    "unique_consecutive",
    "equal",
    "is_nonzero",
)


class Reads(TorchDispatchMode):
    """Counts the operators of :data:`WAITING_OPS`, and boolean-mask indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        masks = name == "index" and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool
            for t in (args[1] if len(args) > 1 else [])
            if t is not None
        )
        if name in WAITING_OPS or masks:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counted(monkeypatch: pytest.MonkeyPatch):
    seen: list[str] = []
    for name in READS:
        method = getattr(torch.Tensor, name)

        def wrapper(self, *a, __m=method, __n=name, **k):  # noqa: ANN001, ANN202
            seen.append(__n)
            return __m(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    mode = Reads()
    with mode:
        yield seen
    seen += mode.seen
    monkeypatch.undo()


def texts_and_ids(tok) -> tuple[list[str], list[list[int]]]:  # noqa: ANN001
    texts = [TEXTS["long"], TEXTS["short"], TEXTS["query"], TEXTS["unicode"]] * 2
    return texts, [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # Dream's and LLaDA's networks, read bidirectionally
@pytest.mark.parametrize("head_stats", [False, True])
def test_queuing_a_batch_reads_nothing_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, head_stats: bool
) -> None:
    bb, tok = tiny_backbone(arch, tmp_path / arch)
    reader = make_reader(bb, ReadoutConfig(content_filter="regex"))
    texts, ids = texts_and_ids(tok)
    ready = reader.prepare(ids, texts, "passage", 4)
    ready.head_stats = head_stats
    want = reader.run(ready)
    # the GPU's path: the whole head (a CPU reads it a vocabulary block at a time, with a read per block)
    monkeypatch.setattr(type(bb), "projection", lambda self: None)
    with counted(monkeypatch) as seen:
        pending = reader.launch(ready)
    assert seen == [], seen  # nothing read back, no operator whose size depends on the values
    got = pending.result()  # one copy back, here
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (
            a.dense.tobytes(),
            a.sparse_ids.tobytes(),
            a.sparse_weights.tobytes(),
            a.tokens.tobytes(),
            a.stopped,
            a.n_tokens,
        ) == (
            b.dense.tobytes(),
            b.sparse_ids.tobytes(),
            b.sparse_weights.tobytes(),
            b.tokens.tobytes(),
            b.stopped,
            b.n_tokens,
        )
        assert (a.entropy is None) == (not head_stats)


def test_encode_rows_asks_for_a_batch_after_queuing_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bb, tok = tiny_backbone("qwen2", tmp_path / "q")
    reader = make_reader(bb, ReadoutConfig(content_filter="regex"))
    texts, ids = texts_and_ids(tok)
    events: list[str] = []
    launch = type(reader).launch

    def traced(self, batch):  # noqa: ANN001, ANN202
        n = len(events)
        events.append(f"launch {n}")
        pending = launch(self, batch)
        finish = pending._finish
        pending._finish = lambda: events.append(f"result of launch {n}") or finish()
        return pending

    monkeypatch.setattr(type(reader), "launch", traced)
    encode_rows(reader, [str(i) for i in range(len(ids))], ids, texts, side="passage", k=4, batch_size=3)
    assert events == [
        "launch 0",
        "launch 1",
        "result of launch 0",
        "launch 3",
        "result of launch 1",
        "result of launch 3",
    ], events


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_readout_waits_no_more_than_the_trunk_alone(tmp_path: Path) -> None:
    """torch's synchronisation check around one queued batch: the readout's reads (the head, the slots, the sparse
    vectors, the copy back started) add none to those of the trunk's own forward pass."""
    bb, tok = tiny_backbone("qwen2", tmp_path / "q")
    bb.model.to("cuda")
    bb.device = torch.device("cuda")
    reader = make_reader(bb, ReadoutConfig(content_filter="regex"))
    texts, ids = texts_and_ids(tok)
    ready = reader.prepare(ids, texts, "passage", 4)
    ready.head_stats = True
    reader.run(ready)  # warm up: kernels loaded, allocator filled

    def syncs(fn) -> int:  # noqa: ANN001
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.inference_mode():
                    fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message).lower() for w in caught)

    b = ready.mask_batch
    inputs = [t.to("cuda", non_blocking=True) for t in (b.input_ids, b.attention_mask)]
    trunk = syncs(lambda: bb.hidden_states(*inputs, bidirectional=True))
    pending = None

    def queue() -> None:
        nonlocal pending
        pending = reader.launch(ready)

    assert syncs(queue) <= trunk
    assert len(pending.result()) == len(ids)
