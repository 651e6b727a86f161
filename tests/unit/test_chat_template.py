import pytest

from engram.server.chat import render_chat

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_simple_template_when_the_model_has_none():
    assert render_chat(MSGS, None) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert render_chat(MSGS, None, add_generation_prompt=False) == "<|system|>\nBe brief.\n<|user|>\nHi\n"


def test_jinja_template_gets_messages_and_special_tokens():
    tpl = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}" \
          "{% if add_generation_prompt %}[assistant]{% endif %}"
    assert render_chat(MSGS, tpl, True, "<s>", "</s>") == "<s>[system]Be brief.[user]Hi[assistant]"


def test_broken_or_unsafe_template_is_a_value_error():
    with pytest.raises(ValueError, match="chat template failed"):
        render_chat(MSGS, "{{ messages[0].content | nosuchfilter }}")
    with pytest.raises(ValueError, match="chat template failed"):  # the sandbox blocks attribute escapes
        render_chat(MSGS, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
