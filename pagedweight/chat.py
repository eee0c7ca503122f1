"""Chat messages -> one prompt through the model's chat template, as transformers' `apply_chat_template` renders it.

The template is the checkpoint's: `chat_template.jinja`, else tokenizer_config.json's "chat_template" (a string, or
a list of named templates of which "default" is used). Rendering follows transformers: a sandboxed Jinja
environment with trim_blocks and lstrip_blocks and the loop-control extension, `raise_exception`, `tojson` and
`strftime_now`, the tokenizer's special tokens (bos_token, eos_token, ...) as variables, add_generation_prompt=True,
and the caller's extra variables (the API's `chat_template_kwargs`, e.g. Qwen3's enable_thinking). The prompt is
then tokenized without the tokenizer's own special tokens, since the template writes them.

A checkpoint without a template gets DEFAULT_TEMPLATE: role-prefixed turns and the assistant's cue, tokenized as any
prompt (with the tokenizer's special tokens). It is what the bundled model serves, and what every chat prompt was
before checkpoint templates were read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from jinja2 import nodes
from jinja2.ext import Extension

DEFAULT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant:{% endif %}")


class ChatTemplateError(ValueError):
    """The template refused the messages (its raise_exception) or failed to render them."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@dataclass
class ChatTemplate:
    source: str | None  # the checkpoint's template; None: DEFAULT_TEMPLATE
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... -> their text

    @property
    def add_special_tokens(self) -> bool:
        """Whether the rendered prompt is tokenized with the tokenizer's special tokens (only without a template of
        the checkpoint's: a template writes its own)."""
        return self.source is None

    @cached_property
    def _compiled(self):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _GenerationTag])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        return env.from_string(self.source if self.source is not None else DEFAULT_TEMPLATE)

    def render(self, messages: list[dict], **variables) -> str:
        """The prompt text of `messages` (dicts with "role" and "content"), ending with the assistant's cue."""
        try:
            # tools and documents None, as transformers passes them (undefined, `tools is not none` held)
            return self._compiled.render(**{**self.special_tokens, "add_generation_prompt": True, "tools": None,
                                            "documents": None, **variables, "messages": messages})
        except ChatTemplateError:
            raise
        except Exception as e:  # a syntax error, or one the template hits on these messages (a TypeError, ...)
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body: transformers marks the assistant's tokens with it
    (for training masks); a template using it failed to compile here."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def template_of(tokenizer_config: dict, jinja_file: str | None) -> str | None:
    """The checkpoint's chat template: chat_template.jinja's text, else tokenizer_config.json's "chat_template"."""
    if jinja_file is not None:
        return jinja_file
    value = tokenizer_config.get("chat_template")
    if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def special_tokens_of(tokenizer_config: dict) -> dict[str, str]:
    """bos_token, eos_token, unk_token, pad_token as text (a token may be written as {"content": ...})."""
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out
