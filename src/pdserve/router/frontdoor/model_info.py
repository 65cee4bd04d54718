"""What the router needs from the checkpoint, torch-free: tokenizer (text and
chat), incremental detokenizer, vocabulary size, context length, EOS ids.
Without a model directory only token-id prompts are accepted."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.errors import FailedPreconditionError, InvalidRequestError

from .text import Detokenizer

UNLIMITED = 2**31 - 1


_SNAPSHOT = re.compile(r"[0-9a-f]{40}")


def model_name(model_dir: str | Path) -> str:
    """A model's name, never a path: config.json `_name_or_path` when it is a hub id
    (org/name), the hub cache's `models--org--name` for a snapshot directory, else the
    directory's name."""
    path = Path(model_dir).resolve()
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = {}
    declared = str(raw.get("_name_or_path") or "") if isinstance(raw, dict) else ""
    if declared and not declared.startswith(("/", ".", "~")) and declared.count("/") <= 1:
        return declared
    if _SNAPSHOT.fullmatch(path.name) and path.parent.name == "snapshots":
        repo = path.parent.parent.name
        if repo.startswith("models--"):
            return repo.removeprefix("models--").replace("--", "/")
    return path.name


class _NoText:
    """Detokenizer for a router without a tokenizer: token ids only, no text."""

    def add(self, token_ids: Sequence[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class ModelInfo:
    name: str = ""  # the model's name (not its path), see model_name()
    dtype: str = ""  # the checkpoint's dtype (config.json torch_dtype)
    vocab_size: int = UNLIMITED
    max_model_len: int = UNLIMITED
    eos_token_ids: list[int] = field(default_factory=list)
    tokenizer: Any = None  # pdserve.model.tokenizer.Tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path | None) -> ModelInfo:
        if not model_dir:
            return cls()
        from pdserve.model.config import ModelConfig
        from pdserve.model.tokenizer import Tokenizer

        config = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        eos = list(dict.fromkeys([*config.eos_token_ids, *tokenizer.eos_token_ids]))
        return cls(
            name=model_name(model_dir),
            dtype=config.torch_dtype,
            vocab_size=config.vocab_size,
            max_model_len=config.max_position_embeddings,
            eos_token_ids=eos,
            tokenizer=tokenizer,
        )

    @property
    def known_limits(self) -> tuple[int, int]:
        """(vocab_size, context_length), 0 where unknown (no model directory)."""
        return (
            0 if self.vocab_size == UNLIMITED else self.vocab_size,
            0 if self.max_model_len == UNLIMITED else self.max_model_len,
        )

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise FailedPreconditionError(
                f"{what} needs a tokenizer: start the router with --model DIR (token_ids work)"
            )
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._need_tokenizer("a text prompt").encode(text, add_special_tokens=True))

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        from pdserve.model.tokenizer import ChatTemplateError

        tok = self._need_tokenizer("a chat prompt")
        try:
            rendered = tok.apply_chat_template(
                [{"role": r, "content": c} for r, c in messages], add_generation_prompt=True
            )
        except ChatTemplateError as exc:  # the template refused these messages
            raise InvalidRequestError("chat", str(exc)) from None
        # The template already carries the special tokens (bos, role markers).
        return list(tok.encode(rendered, add_special_tokens=False))

    def detokenizer(self) -> Detokenizer:
        if self.tokenizer is None:
            return _NoText()
        return self.tokenizer.detokenizer()
