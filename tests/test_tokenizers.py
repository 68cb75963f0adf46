"""Tokenizers (data/tokenizers.py): identity, GPT-2 and BERT from local files, BPE specs. CPU only, no network."""

from __future__ import annotations

import pytest
from conftest import SMALL_DOCS, one_line

from cable_lightning.data.datamodule import TokenDataModule
from cable_lightning.data.tokenizers import get_tokenizer, train_bpe

pytestmark = pytest.mark.usefixtures("no_network")


def test_tokenizer_identity_tells_vocabularies_apart(tiny_corpus_dir):
    text = SMALL_DOCS * 3
    a, b, c = train_bpe(text, 300), train_bpe(text, 300), train_bpe(text, 320)
    assert a.identity == b.identity, "training is deterministic"
    assert a.identity["hash"] != c.identity["hash"]
    assert (a.eot_id, a.mask_id) == (0, 1) and a.special_ids == (0, 1)
    info = TokenDataModule(tiny_corpus_dir).describe()
    info.check_tokenizer(info.tokenizer)
    with pytest.raises(ValueError) as exc:
        info.check_tokenizer(c.identity)
    message = one_line(exc)
    assert "bpe:320" in message and "bpe:512" in message


def test_gpt2_from_a_local_rank_file(tmp_path):
    import base64

    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"th": 256, b"the": 257, b" the": 258})
    path = str(tmp_path / "tiny.tiktoken")
    with open(path, "w") as f:  # the .tiktoken format: base64 token, space, rank
        f.writelines(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items())
    tok = get_tokenizer(f"gpt2:{path}")
    assert (tok.vocab_size, tok.eot_id, tok.mask_id) == (260, 259, 260)  # like GPT-2: 50257, 50256, 50257
    text = "the theme of the day <|endoftext|> stays text"
    ids = tok.encode_batch([text])[0]
    assert 258 in ids and tok.eot_id not in ids
    assert tok.decode(ids) == text
    assert tok.identity["kind"] == "tiktoken" and tok.identity == get_tokenizer(f"gpt2:{path}").identity


def test_gpt2_download_failure_is_one_line(monkeypatch):
    import requests
    import tiktoken

    def offline(name):
        raise requests.exceptions.ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError) as exc:
        get_tokenizer("gpt2")
    assert "gpt2:/path/to/r50k_base.tiktoken" in one_line(exc)


def test_bert_from_a_local_vocab(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "token", "##s", ",", "."]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    tok = get_tokenizer(f"bert:{path}")
    assert (tok.eot_id, tok.mask_id, tok.vocab_size) == (3, 4, len(vocab))
    assert tok.encode_batch(["Hello, tokens world."])[0] == [5, 9, 7, 8, 6, 10]  # lower-cased, no [CLS]/[SEP] added
    assert set(tok.special_ids) == {0, 1, 2, 3, 4}
    assert tok.identity["kind"] == "wordpiece"


def test_bpe_spec_alone_is_not_loadable():
    with pytest.raises(ValueError) as exc:
        get_tokenizer("bpe:4096")
    assert "tokenizer.json" in one_line(exc)
