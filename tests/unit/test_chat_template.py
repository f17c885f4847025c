import pytest

from cascade.chat_template import ChatTemplate, ChatTemplateError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_model_template_renders_with_generation_prompt():
    t = ChatTemplate(CHATML)
    out = t.render([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert t.stop_strings() == ()


def test_base_model_gets_a_transcript_and_stops_at_the_next_user_turn():
    t = ChatTemplate(None)
    out = t.render([{"role": "system", "content": "Answer."}, {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}])
    assert out == "Answer.\n\nUser: 2+2?\nAssistant: 4\nUser: 3+3?\nAssistant:"
    assert "\nUser:" in t.stop_strings()


def test_template_that_raises_gives_a_clear_error():
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render([{"role": "user", "content": "x"}])
