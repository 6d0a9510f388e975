"""dcp_jax/tokenizer.py: a model directory's tokenizer.json is used; otherwise bytes."""

from tokenizers import Tokenizer, models, pre_tokenizers

from dcp_jax.serving.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def test_tokenizer_json_in_the_model_directory_is_used(tmp_path):
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path), vocab_size=5, bos_token_id=0, eos_token_id=1)
    assert isinstance(loaded, HFTokenizer)
    assert loaded.encode("hello world") == [0, 3, 4]
    assert loaded.encode("hello world", add_special_tokens=False) == [3, 4]
    assert loaded.decode([3, 4]) == "hello world"


def test_without_tokenizer_json_bytes_are_used(tmp_path):
    loaded = load_tokenizer(str(tmp_path), vocab_size=512, bos_token_id=0, eos_token_id=1)
    assert isinstance(loaded, ByteTokenizer)
    assert loaded.decode(loaded.encode("héllo", add_special_tokens=False)) == "héllo"
