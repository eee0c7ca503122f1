"""Text <-> token ids for a HF model directory: tokenizer.json through the `tokenizers` library, with
bos/eos from generation_config.json (falling back to config.json), as transformers' generate uses them, and the
chat template with the special tokens' text from tokenizer_config.json / chat_template.jinja (pagedweight.chat)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from pagedweight.chat import ChatTemplate, special_tokens_of, template_of
from pagedweight.checkpoint import (CHAT_TEMPLATE, CONFIG, GENERATION_CONFIG, TOKENIZER, TOKENIZER_CONFIG,
                                    CheckpointError, read_json)


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else () if value is None else (int(value),)


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: ChatTemplate = field(default_factory=lambda: ChatTemplate(None))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TextTokenizer":
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found (the model directory needs a tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a plain Exception subclass on bad JSON
            raise CheckpointError(f"{path}: not a readable tokenizer ({e})") from None
        ids = read_json(model_dir / CONFIG) if (model_dir / CONFIG).is_file() else {}
        if (model_dir / GENERATION_CONFIG).is_file():
            gen = read_json(model_dir / GENERATION_CONFIG)
            ids = {k: gen[k] if gen.get(k) is not None else ids.get(k) for k in ("bos_token_id", "eos_token_id")}
        config = read_json(model_dir / TOKENIZER_CONFIG) if (model_dir / TOKENIZER_CONFIG).is_file() else {}
        jinja = (model_dir / CHAT_TEMPLATE).read_text() if (model_dir / CHAT_TEMPLATE).is_file() else None
        template = ChatTemplate(template_of(config, jinja), special_tokens_of(config))
        return cls(tokenizer, ids.get("bos_token_id"), _ids(ids.get("eos_token_id")), template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages: list[dict], **variables) -> list[int]:
        """The token ids of `messages` rendered by the chat template, ending with the assistant's cue (as
        transformers' apply_chat_template(messages, add_generation_prompt=True, tokenize=True)); raises
        pagedweight.chat.ChatTemplateError when the template refuses them."""
        text = self.chat_template.render(messages, **variables)
        return self.encode(text, add_special_tokens=self.chat_template.add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
