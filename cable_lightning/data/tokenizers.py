"""Tokenizers behind one small interface: GPT-2 BPE (tiktoken), BERT WordPiece and corpus-trained byte-level BPE
(HF ``tokenizers``).

Specs understood by :func:`get_tokenizer`:

==========================  ===============================================================================
``gpt2``                    tiktoken's GPT-2 BPE (downloaded once by tiktoken, then cached)
``gpt2:/path/x.tiktoken``   the same ranks from a local file (``r50k_base.tiktoken`` is GPT-2's), offline
``bert-base-uncased``       WordPiece from the Hugging Face hub
``bert:/path/vocab.txt``    WordPiece from a local vocab (lower-cased, like bert-base-uncased)
``/path/tokenizer.json``    any saved HF tokenizer, e.g. the ``bpe:N`` one that prepare writes beside the shards
``bpe:N``                   a byte-level BPE of N tokens; only :func:`train_bpe` (called by prepare) makes one
==========================  ===============================================================================

Ids: ``eot_id`` separates documents in the token stream. ``mask_id`` is the MLM mask, or None for a
tokenizer.json without one (GPT-2's own, most causal LMs'): causal training does not need it, MLM refuses it.
tiktoken's GPT-2 has no mask token either; its ``mask_id`` is 50257, the first id past its vocabulary (models pad
the embedding to 50304 rows, so the id exists there).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

EOT_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
TOKENIZER_FILE = "tokenizer.json"

_VALID_SPECS = "gpt2, gpt2:/path/r50k_base.tiktoken, bert-base-uncased, bert:/path/vocab.txt, bpe:N or a tokenizer.json path"


def _sha256(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


class Tokenizer:
    """Uniform wrapper: ``encode``/``decode`` plus the ids and the identity the data manifest records."""

    kind: str  # "tiktoken" | "wordpiece" | "bpe"
    name: str  # the spec a user would type: "gpt2", "bert-base-uncased", "bpe:4096"
    eot_id: int
    mask_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def _vocab_hash(self) -> str:
        raise NotImplementedError

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids MLM masking must never choose (document separators, padding, ...)."""
        return (self.eot_id,)

    @property
    def identity(self) -> dict[str, Any]:
        """What a checkpoint stores to prove it was trained on the same ids: kind, name and a vocabulary hash."""
        if not hasattr(self, "_identity"):
            self._identity = {"kind": self.kind, "name": self.name, "hash": self._vocab_hash()}
        return dict(self._identity)


class TiktokenTokenizer(Tokenizer):
    """GPT-2 BPE via tiktoken. ``encode`` never turns "<|endoftext|>" inside a document into the separator id."""

    kind = "tiktoken"

    def __init__(self, encoding: Any, name: str = "gpt2"):
        self.enc = encoding
        self.name = name
        self.eot_id = encoding.eot_token
        self.vocab_size = encoding.n_vocab
        self.mask_id = self.vocab_size  # first padded slot: GPT-2 has no mask token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids])

    def _vocab_hash(self) -> str:
        ranks = [self.enc.decode_single_token_bytes(i).hex() for i in range(self.vocab_size)]
        return _sha256({"ranks": ranks, "pattern": getattr(self.enc, "_pat_str", None)})


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (WordPiece or byte-level BPE)."""

    def __init__(self, tok: Any, name: str, kind: str):
        self.tok = tok
        self.name = name
        self.kind = kind
        # Literal "<|endoftext|>" or "[SEP]" inside a document must stay text, not become a separator id.
        tok.encode_special_tokens = True
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        eot = next((t for t in (EOT_TOKEN, "[SEP]", "</s>") if t in vocab), None)
        if eot is None:
            raise ValueError(f"tokenizer {name!r} has no document separator ({EOT_TOKEN}, [SEP] or </s>); valid: {_VALID_SPECS}")
        mask = next((t for t in (MASK_TOKEN, "[MASK]", "<mask>") if t in vocab), None)
        self.eot_id, self.mask_id = vocab[eot], None if mask is None else vocab[mask]
        specials = {i for i, added in tok.get_added_tokens_decoder().items() if added.special} | {self.eot_id}
        self._specials = tuple(sorted(specials | ({self.mask_id} if mask else set())))

    @property
    def special_ids(self) -> tuple[int, ...]:
        return self._specials

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def _vocab_hash(self) -> str:
        model = json.loads(self.tok.to_str()).get("model", {})
        vocab = sorted(self.tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return _sha256({"type": model.get("type"), "vocab": vocab, "merges": model.get("merges", [])})

    def save(self, path: str) -> None:
        self.tok.save(path)


def train_bpe(documents: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (specials "<|endoftext|>"=0 and "<|mask|>"=1 included).

    Byte-level means any text round-trips through encode/decode exactly, which the prepare tests rely on.
    """
    from tokenizers import Tokenizer as _HF, decoders, models, pre_tokenizers, trainers

    minimum = 256 + 2
    if vocab_size < minimum:
        raise ValueError(f"bpe vocab size {vocab_size} is too small; use bpe:N with N >= {minimum} (256 bytes + 2 specials)")
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return HFTokenizer(tok, name=f"bpe:{vocab_size}", kind="bpe")


def parse_bpe_spec(spec: str) -> int | None:
    """``"bpe:4096"`` -> 4096; any other spec -> None."""
    if not spec.startswith("bpe:"):
        return None
    size = spec[4:]
    if not size.isdigit():
        raise ValueError(f"bad tokenizer spec {spec!r}: bpe needs a vocabulary size, e.g. bpe:4096")
    return int(size)


def get_tokenizer(spec: str, name: str | None = None) -> Tokenizer:
    """Build a tokenizer from a spec (see the module docstring); ``name`` overrides the recorded name."""
    spec = str(spec)
    if spec == "gpt2":
        import tiktoken

        try:
            return TiktokenTokenizer(tiktoken.get_encoding("gpt2"), name="gpt2")
        except Exception as exc:  # requests/urllib errors differ by version; all mean "could not fetch"
            raise RuntimeError(
                f"cannot download the GPT-2 BPE for tiktoken (offline? {type(exc).__name__}); use "
                "--tokenizer gpt2:/path/to/r50k_base.tiktoken, set TIKTOKEN_CACHE_DIR to a filled cache, or use bpe:N"
            ) from None
    if spec.startswith("gpt2:"):
        return _tiktoken_from_file(spec[5:], name or "gpt2")
    if spec == "bert-base-uncased":
        from tokenizers import Tokenizer as _HF

        try:
            tok = _HF.from_pretrained("bert-base-uncased")
        except Exception as exc:
            raise RuntimeError(
                f"cannot download bert-base-uncased from the Hugging Face hub (offline? {type(exc).__name__}); "
                "use --tokenizer bert:/path/to/vocab.txt or bpe:N"
            ) from None
        return HFTokenizer(tok, name=name or "bert-base-uncased", kind="wordpiece")
    if spec.startswith("bert:"):
        path = spec[5:]
        if not os.path.isfile(path):
            raise FileNotFoundError(f"BERT vocab file not found: {path}; pass bert:/path/to/vocab.txt (one token a line)")
        from tokenizers.implementations import BertWordPieceTokenizer

        wp = BertWordPieceTokenizer(path, lowercase=True)
        return HFTokenizer(wp._tokenizer, name=name or "bert-base-uncased", kind="wordpiece")
    if parse_bpe_spec(spec) is not None:
        raise ValueError(
            f"{spec} is trained on a corpus by `python -m cable_lightning.data.prepare --tokenizer {spec}`; "
            "to load a trained one pass its tokenizer.json path"
        )
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"tokenizer file not found: {spec}; prepare the data again or pass an existing tokenizer.json")
        from tokenizers import Tokenizer as _HF

        tok = _HF.from_file(spec)
        model_type = json.loads(tok.to_str()).get("model", {}).get("type", "")
        kind = "wordpiece" if model_type == "WordPiece" else "bpe"
        return HFTokenizer(tok, name=name or os.path.basename(os.path.dirname(os.path.abspath(spec))), kind=kind)
    raise ValueError(f"unknown tokenizer {spec!r}; valid: {_VALID_SPECS}")


def _tiktoken_from_file(path: str, name: str) -> TiktokenTokenizer:
    """Rebuild GPT-2's encoding from a local ``.tiktoken`` rank file; the separator takes the id after the ranks."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"tiktoken rank file not found: {path}; download r50k_base.tiktoken (GPT-2's ranks) on a connected machine"
        )
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenizer regex

    try:
        ranks = load_tiktoken_bpe(path)
    except Exception as exc:
        raise ValueError(f"cannot read {path} as a .tiktoken rank file ({type(exc).__name__}: {exc})") from None
    n = len(ranks)
    enc = tiktoken.Encoding(name=name, pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={EOT_TOKEN: n})
    return TiktokenTokenizer(enc, name=name)
