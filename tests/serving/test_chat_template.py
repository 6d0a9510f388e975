"""dcp_jax/serving/chat_template.py: where a checkpoint's template is found, what --chat-template takes, and
rendering as transformers does (its jinja environment; continue_final_message). No engine: the server's use of
them is in test_server.py."""

import json

import pytest

from dcp_jax.serving.chat_template import (PLAIN_CHAT_TEMPLATE, ChatTemplateError, chat_template_option,
                                           checkpoint_chat_template, render_chat)
from dcp_jax.serving.tokenizer import ByteTokenizer, TokenizerView, load_tokenizer
from dcp_jax.train.retrieval import chat_prompt


def test_a_checkpoint_ships_its_template_in_chat_template_jinja_or_tokenizer_config(tmp_path):
    assert checkpoint_chat_template(str(tmp_path)) is None and checkpoint_chat_template(None) is None
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{{ 'A' }}", "bos_token": "<s>"}))
    assert checkpoint_chat_template(str(tmp_path)) == "{{ 'A' }}"
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"},
                                                    {"name": "default", "template": "D"}]}))
    assert checkpoint_chat_template(str(tmp_path)) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")  # transformers' newer file wins
    assert checkpoint_chat_template(str(tmp_path)) == "J"
    assert load_tokenizer(str(tmp_path), 300, 0, 1).chat_template == "J"


def test_dsa_tiny_ships_the_format_it_was_trained_on():
    import os

    from dcp_jax.config import CHECKPOINTS_DIR

    tokenizer = load_tokenizer(os.path.join(CHECKPOINTS_DIR, "dsa-tiny"), 258, 0, 1)
    assert tokenizer.chat_template == PLAIN_CHAT_TEMPLATE
    view = TokenizerView(tokenizer, bos_token_id=0, eos_token_id=1)
    text = render_chat(tokenizer.chat_template, [{"role": "user", "content": "k abcd=v1234;?kabcd="}],
                       add_generation_prompt=True, bos_token=view.special_text(0))
    assert view.encode(text, add_special_tokens=False) == ByteTokenizer(258).encode(chat_prompt("k abcd=v1234;?kabcd="))


def test_the_chat_template_option_is_a_file_or_a_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert chat_template_option(str(path)) == "{{ messages[0]['content'] }}"
    assert chat_template_option("{{ bos_token }}") == "{{ bos_token }}"
    with pytest.raises(ValueError, match="neither a readable file"):
        chat_template_option(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not compile"):
        chat_template_option("{% if %}")


def test_rendering_follows_transformers():
    # trim_blocks and lstrip_blocks: no newline after a tag, none of a tag line's indentation.
    template = "{% for m in messages %}\n    {% if m['role'] == 'user' %}\nU:{{ m['content'] }}|{{ m | tojson }}\n" \
               "    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}"
    text = render_chat(template, [{"role": "user", "content": "é"}], add_generation_prompt=True)
    assert text == 'U:é|{"role": "user", "content": "é"}\nA:'
    with pytest.raises(ChatTemplateError, match="refused the conversation: no"):
        render_chat("{{ raise_exception('no') }}", [], add_generation_prompt=False)
    with pytest.raises(ChatTemplateError, match="both"):
        render_chat(template, [], add_generation_prompt=True, continue_final_message=True)
    assert render_chat("{{ strftime_now('%Y') | length }}", [], add_generation_prompt=False) == "4"
    # The sandbox: no attribute of Python's internals.
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__ }}", [], add_generation_prompt=False)


def test_continue_final_message_ends_the_text_with_the_last_messages_content():
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<end>{% endfor %}"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    assert render_chat(template, messages, add_generation_prompt=False, continue_final_message=True) == \
        "<user>q<end><assistant>The answer is"
    with pytest.raises(ChatTemplateError, match="does not print the last message"):
        render_chat("{{ 'x' }}", messages, add_generation_prompt=False, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_the_messages():
    template = "{{ messages | length }}{% if enable_thinking %}T{% endif %}"
    messages = [{"role": "user", "content": "x"}]
    assert render_chat(template, messages, add_generation_prompt=False, template_kwargs={"enable_thinking": True}) \
        == "1T"
    assert render_chat(template, messages, add_generation_prompt=False, template_kwargs={"messages": [1, 2, 3]}) \
        == "1"
