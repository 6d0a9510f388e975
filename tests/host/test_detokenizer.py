"""dcp_jax/host/detokenizer.py: token by token, the text equals the decode of the whole sequence, with unfinished
UTF-8 held back, for the byte tokenizer and a byte-level BPE one."""

import pytest

from dcp_jax.host.detokenizer import IncrementalDetokenizer
from dcp_jax.serving.tokenizer import ByteTokenizer

TEXTS = ["hello, world", "naïve café – ünïcödé ✓ 漢字 🙂 end", "a\nb\tc  d"]


def _check(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.decode)
    pieces = [detok.add([i]) for i in ids]
    for piece in pieces:
        assert "\ufffd" not in piece
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids) == detok.text


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_text_is_the_whole_decode(text):
    _check(ByteTokenizer(512), text)


def test_an_unfinished_character_is_held_until_it_completes():
    tok = ByteTokenizer(512)
    ids = tok.encode("🙂", add_special_tokens=False)  # four UTF-8 bytes
    detok = IncrementalDetokenizer(tok.decode)
    assert [detok.add([i]) for i in ids] == ["", "", "", "🙂"]


def test_flush_gives_what_an_unfinished_tail_decodes_to():
    tok = ByteTokenizer(512)
    detok = IncrementalDetokenizer(tok.decode)
    assert detok.add(tok.encode("ok", add_special_tokens=False)) == "ok"
    assert detok.add(tok.encode("é", add_special_tokens=False)[:1]) == ""
    assert detok.flush() == "\ufffd" and detok.text == "ok\ufffd"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_text_is_the_whole_decode(text, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TEXTS * 20, trainer)
    path = tmp_path / "tokenizer.json"
    bpe.save(str(path))
    from dcp_jax.serving.tokenizer import HFTokenizer

    _check(HFTokenizer(str(path), bos_token_id=None, eos_token_id=None), text)
