"""Jinja chat-template rendering with the globals and filters HF `apply_chat_template` and llama.cpp provide.

Mirrors transformers' `render_jinja_template` (sandboxed environment, trim_blocks/lstrip_blocks,
`raise_exception`, `strftime_now`, `tojson`), which is what llama.cpp's `--jinja` path emulates.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """A chat template failed to compile or render (HTTP layers map this to a 400/500)."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # HF's filter: unlike jinja's built-in it does not HTML-escape, so templates can emit raw JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(template: str) -> jinja2.Template:
    if not template:
        raise TemplateError("the model has no chat template")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None


class ChatTemplate:
    """A compiled chat template; build once per model (compiling costs milliseconds, rendering less)."""

    def __init__(self, template: str):
        self.source = template
        self._compiled = _compile(template)

    def apply(self, messages, add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
              **kwargs) -> str:
        """Render `messages` (list of {"role", "content", ...}).

        Extra keyword arguments (tools, documents, enable_thinking, ...) become template variables.
        Any render failure, including the template's own `raise_exception`, raises `TemplateError`.
        """
        try:
            return self._compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **kwargs)
        except jinja2.exceptions.TemplateError as e:  # includes raise_exception() and sandbox violations
            raise TemplateError(f"chat template error: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError, ValueError, ZeroDivisionError) as e:
            raise TemplateError(f"chat template error: {type(e).__name__}: {e}") from None


def apply_chat_template(template: str, messages, add_generation_prompt: bool = True, bos_token: str = "",
                        eos_token: str = "", **kwargs) -> str:
    """One-shot `ChatTemplate(template).apply(...)`; raises `TemplateError` (a ValueError) on failure."""
    return ChatTemplate(template).apply(messages, add_generation_prompt, bos_token, eos_token, **kwargs)
