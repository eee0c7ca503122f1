"""Text <-> token ids for a HF model directory: tokenizer.json through the `tokenizers` library, with
bos/eos from generation_config.json (falling back to config.json), as transformers' generate uses them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from pagedweight.checkpoint import CONFIG, GENERATION_CONFIG, TOKENIZER, CheckpointError, read_json


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else () if value is None else (int(value),)


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

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
        return cls(tokenizer, ids.get("bos_token_id"), _ids(ids.get("eos_token_id")))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
