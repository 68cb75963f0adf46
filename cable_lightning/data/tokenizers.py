"""Tokenizers behind one small interface: GPT-2 BPE (tiktoken), BERT WordPiece and corpus-trained byte-level BPE
(HF ``tokenizers``). Specs: ``gpt2`` (tiktoken's download), ``gpt2:/path/r50k_base.tiktoken`` (offline),
``bert-base-uncased`` (the hub), ``bert:/path/vocab.txt`` (offline, lower-cased), ``/path/tokenizer.json`` (any saved
HF tokenizer) and ``bpe:N`` (trained on the corpus by prepare, saved beside the data).

``eot_id`` separates documents. ``mask_id`` is the MLM mask, or None for a tokenizer.json without one (causal
training does not need it; MLM refuses it). tiktoken's GPT-2 has no mask token; its ``mask_id`` is 50257, the first
id past its vocabulary (models pad the embedding to 50304 rows). ``identity`` (kind, name, vocabulary hash) is what
manifests and checkpoints record to prove two runs use the same ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import ConfigError, MissingFileError

EOT_TOKEN, MASK_TOKEN, TOKENIZER_FILE = "<|endoftext|>", "<|mask|>", "tokenizer.json"
VALID_SPECS = ("gpt2, gpt2:/path/r50k_base.tiktoken, bert-base-uncased, bert:/path/vocab.txt, bpe:N "
               "or a tokenizer.json path")


def _sha256(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


class TiktokenTokenizer:
    """GPT-2 BPE via tiktoken; a literal "<|endoftext|>" inside a document stays text."""

    kind = "tiktoken"

    def __init__(self, encoding: Any, name: str = "gpt2"):
        self.enc, self.name, self.eot_id, self.vocab_size = encoding, name, encoding.eot_token, encoding.n_vocab
        self.mask_id, self.special_ids = self.vocab_size, (self.eot_id,)  # the mask takes the first padded slot
        ranks = [encoding.decode_single_token_bytes(i).hex() for i in range(self.vocab_size)]
        self.identity = {"kind": self.kind, "name": name,
                         "hash": _sha256({"ranks": ranks, "pattern": getattr(encoding, "_pat_str", None)})}

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids])

    def char_starts(self, texts: Sequence[str]) -> list[list[int]]:
        """Where each token of each text begins, in characters."""
        return [self.enc.decode_with_offsets(ids)[1] for ids in self.encode_batch(texts)]


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (WordPiece or byte-level BPE)."""

    def __init__(self, tok: Any, name: str, kind: str):
        self.tok, self.name, self.kind = tok, name, kind
        tok.encode_special_tokens = True  # a literal "<|endoftext|>" or "[SEP]" in a document stays text
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        eot = next((t for t in (EOT_TOKEN, "[SEP]", "</s>") if t in vocab), None)
        if eot is None:
            raise ConfigError(f"tokenizer {name!r} has no document separator ({EOT_TOKEN}, [SEP] or </s>); "
                              f"valid: {VALID_SPECS}")
        mask = next((vocab[t] for t in (MASK_TOKEN, "[MASK]", "<mask>") if t in vocab), None)
        self.eot_id, self.mask_id = vocab[eot], mask
        specials = {i for i, added in tok.get_added_tokens_decoder().items() if added.special}
        self.special_ids = tuple(sorted(specials | {self.eot_id} | ({mask} if mask is not None else set())))
        model = json.loads(tok.to_str()).get("model", {})
        ordered = sorted(vocab.items(), key=lambda kv: kv[1])
        self.identity = {"kind": kind, "name": name,
                         "hash": _sha256({"type": model.get("type"), "vocab": ordered,
                                          "merges": model.get("merges", [])})}

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def char_starts(self, texts: Sequence[str]) -> list[list[int]]:
        """Where each token of each text begins, in characters."""
        return [[start for start, _ in e.offsets] for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def save(self, path: str) -> None:
        self.tok.save(path)


Tokenizer = TiktokenTokenizer | HFTokenizer


def train_bpe(documents: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` ids ("<|endoftext|>"=0 and "<|mask|>"=1): any text round-trips exactly."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ConfigError(f"bpe vocab size {vocab_size} is too small; use bpe:N with N >= 258 (256 bytes + 2 specials)")
    tok = HF(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TOKEN, MASK_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer=trainer)
    return HFTokenizer(tok, name=f"bpe:{vocab_size}", kind="bpe")


def parse_bpe_spec(spec: str) -> int | None:
    """``"bpe:4096"`` -> 4096; any other spec -> None."""
    if not spec.startswith("bpe:"):
        return None
    if not spec[4:].isdigit():
        raise ConfigError(f"bad tokenizer spec {spec!r}: bpe needs a vocabulary size, e.g. bpe:4096")
    return int(spec[4:])


def _offline(what: str, exc: Exception, instead: str) -> RuntimeError:
    return RuntimeError(f"cannot download {what} (offline? {type(exc).__name__}); use {instead}")


def tokenizer_file(spec: str) -> str | None:
    """The local file a spec reads (``gpt2:PATH``, ``bert:PATH``, a tokenizer.json path), or None (downloaded or
    trained): an input an overwrite must never delete."""
    spec = str(spec)
    if spec.startswith(("gpt2:", "bert:")):
        return spec.partition(":")[2]
    return spec if spec.endswith(".json") else None


def get_tokenizer(spec: str, name: str | None = None) -> Tokenizer:
    """Build a tokenizer from a spec (see the module docstring); ``name`` overrides the recorded name."""
    import tiktoken
    from tokenizers import Tokenizer as HF

    spec = str(spec)
    if spec == "gpt2":
        try:
            return TiktokenTokenizer(tiktoken.get_encoding("gpt2"), name="gpt2")
        except Exception as exc:  # requests/urllib errors differ by version; all mean "could not fetch"
            raise _offline("the GPT-2 BPE for tiktoken", exc, "--tokenizer gpt2:/path/to/r50k_base.tiktoken, set "
                           "TIKTOKEN_CACHE_DIR to a filled cache, or use bpe:N") from None
    if spec == "bert-base-uncased":
        try:
            return HFTokenizer(HF.from_pretrained("bert-base-uncased"), name=name or spec, kind="wordpiece")
        except Exception as exc:
            raise _offline("bert-base-uncased from the Hugging Face hub", exc,
                           "--tokenizer bert:/path/to/vocab.txt or bpe:N") from None
    if parse_bpe_spec(spec) is not None:
        raise ConfigError(f"{spec} is trained on a corpus by "
                          f"`python -m cable_lightning prepare --tokenizer {spec}`; "
                          "to load a trained one pass its tokenizer.json path")
    path = tokenizer_file(spec)
    kind = spec.partition(":")[0] if spec.startswith(("gpt2:", "bert:")) else "json"
    if path is None:
        raise ConfigError(f"unknown tokenizer {spec!r}; valid: {VALID_SPECS}")
    if not os.path.isfile(path):
        raise MissingFileError(f"tokenizer file not found: {path}; valid tokenizers: {VALID_SPECS}")
    if kind == "bert":
        from tokenizers.implementations import BertWordPieceTokenizer

        return HFTokenizer(BertWordPieceTokenizer(path, lowercase=True)._tokenizer, name=name or "bert-base-uncased",
                           kind="wordpiece")
    if kind == "gpt2":  # GPT-2's ranks from a local .tiktoken file; the separator takes the id after the ranks
        from tiktoken.load import load_tiktoken_bpe
        from tiktoken_ext.openai_public import (
            r50k_pat_str,  # GPT-2's pre-tokenizer regex
        )

        try:
            ranks = load_tiktoken_bpe(path)
        except Exception as exc:
            raise ConfigError(f"cannot read {path} as a .tiktoken rank file ({type(exc).__name__}: {exc})") from None
        encoding = tiktoken.Encoding(name=name or "gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                     special_tokens={EOT_TOKEN: len(ranks)})
        return TiktokenTokenizer(encoding, name=name or "gpt2")
    tok = HF.from_file(path)
    kind = "wordpiece" if json.loads(tok.to_str()).get("model", {}).get("type") == "WordPiece" else "bpe"
    return HFTokenizer(tok, name=name or os.path.basename(os.path.dirname(os.path.abspath(path))), kind=kind)
