"""Tiny random models and in-test tokenizers for the readout tests (nothing is downloaded).

Four architectures: ``bert`` (BertForMaskedLM + a WordPiece vocab.txt), ``modernbert`` (ModernBertForMaskedLM +
the same WordPiece vocabulary), ``qwen2`` (Qwen2ForCausalLM + a byte-level BPE trained here, ChatML template,
eos = ``<|im_end|>`` as in Qwen2.5-Instruct) and ``llama`` (LlamaForCausalLM + a word-level tokenizer that keeps
``\\n``, ChatML template, eos = ``<|endoftext|>``, pad = ``<pad>``). The vocabularies cover the built-in prompt
files, so prompts tokenize without unknown tokens.
"""

from __future__ import annotations

import re
import string
from importlib import resources
from pathlib import Path

import torch
import yaml

ARCHS = ("bert", "modernbert", "qwen2", "llama")
CAUSAL_ARCHS = ("qwen2", "llama")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Texts the tests encode: short and long, with stopwords and punctuation around the content words.
TEXTS = {
    "short": "cats purr",
    "query": "what do dogs do in the garden?",
    "long": (
        "the quick brown fox jumps over the lazy dog, while cats purr softly in the warm garden and dogs bark "
        "loudly at the mailman; retrieval models represent every passage with a few lowercase words."
    ),
    "unicode": "tea, coffee and cocoa: which drink is best?",
}

CORPUS_WORDS = """the a an and or of to in on at is are was be do does what which who how with while over every
few one word words query passage retrieval task use make sure your lowercase represent models model quick brown
fox jumps lazy dog dogs cat cats purr purrs softly warm garden bark barks loudly mailman tea coffee cocoa drink best
hello x user assistant system""".split()


def prompt_words() -> list[str]:
    """Every word and punctuation mark of the built-in prompt files (cased, in order, without repeats)."""
    folder = resources.files("diffret.retrieval.models") / "prompts"
    seen: dict[str, None] = {}
    for p in sorted(folder.iterdir(), key=lambda p: p.name):
        if not p.name.endswith(".yaml"):
            continue
        data = yaml.safe_load(p.read_text())
        pieces = [data[s][part] for s in ("query", "passage") for part in ("user_prefix", "user_suffix")]
        for piece in [data.get("system", ""), *pieces, data["assistant_prefix"]]:
            for w in re.findall(r"\w+|[^\w\s]", piece):
                seen.setdefault(w, None)
    return list(seen)


def _all_words() -> list[str]:
    seen: dict[str, None] = {}
    for w in prompt_words() + CORPUS_WORDS + [w for t in TEXTS.values() for w in re.findall(r"\w+", t)]:
        seen.setdefault(w, None)
    return list(seen)


# ------------------------------------------------------------------------------------------------ tokenizers
def bert_tokenizer(folder: Path):
    """BertTokenizerFast (lowercasing WordPiece) from a vocab.txt written to ``folder``."""
    from transformers import BertTokenizerFast

    words = sorted({w.lower() for w in _all_words()} - set(string.punctuation))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(string.punctuation) + words + ["##s", "##ing"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    return BertTokenizerFast(vocab=str(path))  # transformers 5: the vocab.txt path is `vocab`


def _wrap(tk, *, eos: str, pad: str, mask: bool):
    from transformers import PreTrainedTokenizerFast

    kwargs = {"mask_token": "<|mask|>"} if mask else {}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token=eos,
        pad_token=pad,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        **kwargs,
    )
    tok.chat_template = CHATML
    return tok


def bpe_chat_tokenizer(mask: bool = True):
    """Qwen2-like: byte-level BPE trained on the prompt and test texts; eos ``<|im_end|>``, pad ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<|mask|>"] if mask else [])
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(_all_words())] * 3 + list(TEXTS.values()) * 3
    folder = resources.files("diffret.retrieval.models") / "prompts"
    # the prompt files verbatim, comments included: editing any of them changes these tokenizers' merges (e.g. whether
    # "Answer: 0" ends in one token, which the rerankers' tests need)
    corpus += [p.read_text() for p in folder.iterdir() if p.name.endswith(".yaml")]
    tk.train_from_iterator(corpus, trainer=trainer)
    return _wrap(tk, eos="<|im_end|>", pad="<|endoftext|>", mask=mask)


def word_chat_tokenizer(mask: bool = True):
    """Llama-ish ChatML word-level tokenizer: spaces dropped, ``\\n`` and punctuation kept as tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<|mask|>"] if mask else [])
    words = _all_words()
    tokens = dict.fromkeys(specials + ["\n"] + list(string.punctuation) + words + [w.lower() for w in words])
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    tok = _wrap(tk, eos="<|endoftext|>", pad="<pad>", mask=mask)
    tok.unk_token = "<unk>"
    return tok


# ---------------------------------------------------------------------------------------------------- models
def tiny_model(arch: str, tokenizer, seed: int = 0) -> torch.nn.Module:
    """A 2-layer, 32-wide random model of ``arch`` for ``tokenizer`` (eval mode, float32)."""
    import transformers as tf

    torch.manual_seed(seed)
    v = len(tokenizer)
    common = dict(
        vocab_size=v,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
    )
    if arch == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(**common, pad_token_id=tokenizer.pad_token_id))
    elif arch == "modernbert":
        ids = dict(
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.cls_token_id,
            cls_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id,
            sep_token_id=tokenizer.sep_token_id,
        )
        # a small local window so that the sliding-window layers really are local on these inputs
        model = tf.ModernBertForMaskedLM(
            tf.ModernBertConfig(**common, **ids, local_attention=16, global_attn_every_n_layers=2)
        )
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(
            **common,
            num_key_value_heads=1,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
        )
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "llama":
        cfg = tf.LlamaConfig(
            **common,
            num_key_value_heads=1,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
        model = tf.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    return model.float().eval()


def tiny_tokenizer(arch: str, folder: Path, mask: bool = True):
    if arch in ("bert", "modernbert"):
        return bert_tokenizer(folder)
    if arch == "qwen2":
        return bpe_chat_tokenizer(mask=mask)
    if arch == "llama":
        return word_chat_tokenizer(mask=mask)
    raise ValueError(f"unknown tiny arch {arch!r}")


def tiny_backbone(arch: str, folder: Path, seed: int = 0):
    """(Backbone, tokenizer) for ``arch``: family mlm for the encoders, causal for Qwen2 / Llama."""
    from diffret.retrieval.models.backbones import Backbone

    tok = tiny_tokenizer(arch, folder)
    family = "causal" if arch in CAUSAL_ARCHS else "mlm"
    return Backbone(tiny_model(arch, tok, seed=seed), tok, family, name=f"tiny-{arch}"), tok


def save_tiny_mlm(folder: Path, seed: int = 0) -> Path:
    """A tiny random BertForMaskedLM with its WordPiece tokenizer saved as a model folder (loads by path)."""
    tok = bert_tokenizer(folder / "vocab")
    model = tiny_model("bert", tok, seed=seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
