"""dcp_jax/host/detokenizer.py: token by token, the text equals the decode of the whole sequence, with unfinished
UTF-8 held back, for every kind (the windowed one over any decode, the byte tokenizer's stream, HF's stream)."""

import pytest

from dcp_jax.host.detokenizer import IncrementalDetokenizer
from dcp_jax.serving.tokenizer import ByteTokenizer

TEXTS = ["hello, world", "naïve café – ünïcödé ✓ 漢字 🙂 end", "a\nb\tc  d"]


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """A byte-level BPE `tokenizer.json` trained on TEXTS, with two special tokens, through `HFTokenizer`."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TEXTS * 20, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    bpe.save(str(path))
    from dcp_jax.serving.tokenizer import HFTokenizer

    return HFTokenizer(str(path), bos_token_id=0, eos_token_id=1)


KINDS = ["window", "stream"]


def _new(tokenizer, kind):
    return IncrementalDetokenizer(tokenizer.decode) if kind == "window" else tokenizer.new_detokenizer()


def _check(tokenizer, kind, ids):
    detok = _new(tokenizer, kind)
    pieces = [detok.add_one(i) for i in ids]
    for piece in pieces:
        assert "\ufffd" not in piece
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids) == detok.text


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_text_is_the_whole_decode(text, kind):
    tok = ByteTokenizer(512)
    _check(tok, kind, tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_text_is_the_whole_decode(text, kind, bpe_tokenizer):
    _check(bpe_tokenizer, kind, bpe_tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_have_no_text(kind, bpe_tokenizer):
    ids = bpe_tokenizer.encode("hello", add_special_tokens=True) + [1]  # BOS first, EOS last
    assert ids[0] == 0
    _check(bpe_tokenizer, kind, ids)
    tok = ByteTokenizer(512)
    _check(tok, kind, tok.encode("hi", add_special_tokens=True) + [tok.eos_token_id, 400])  # 400: past the bytes


@pytest.mark.parametrize("kind", KINDS)
def test_an_unfinished_character_is_held_until_it_completes(kind, bpe_tokenizer):
    tok = ByteTokenizer(512)
    ids = tok.encode("🙂", add_special_tokens=False)  # four UTF-8 bytes
    detok = _new(tok, kind)
    assert [detok.add_one(i) for i in ids] == ["", "", "", "🙂"]


@pytest.mark.parametrize("kind", KINDS)
def test_flush_gives_what_an_unfinished_tail_decodes_to(kind, bpe_tokenizer):
    for tok in (ByteTokenizer(512), bpe_tokenizer):
        detok = _new(tok, kind)
        ok = tok.encode("ok", add_special_tokens=False)
        assert "".join(detok.add_one(i) for i in ok) == "ok"
        # 0xC3, a byte that starts a two-byte character (the byte-level alphabet spells it "Ã")
        first_byte = [tok.offset + 0xC3] if tok is not bpe_tokenizer else [tok._tok.token_to_id("Ã")]
        assert tok.decode(first_byte) == "\ufffd"
        assert detok.add_one(first_byte[0]) == ""
        assert detok.flush() == "\ufffd" and detok.text == "ok\ufffd" == tok.decode(ok + first_byte)


@pytest.mark.parametrize("kind", KINDS)
def test_invalid_bytes_end_as_the_whole_decode_gives_them(kind):
    tok = ByteTokenizer(512)
    ids = [tok.offset + b for b in (0x61, 0x80, 0x62, 0xC3, 0x28, 0xE2, 0x82)]  # lone continuation, bad pair, cut
    _check_text = _new(tok, kind)
    text = "".join(_check_text.add_one(i) for i in ids) + _check_text.flush()
    assert text == tok.decode(ids) == bytes((0x61, 0x80, 0x62, 0xC3, 0x28, 0xE2, 0x82)).decode("utf-8", "replace")
