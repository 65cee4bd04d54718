"""What the router needs from the checkpoint, torch-free: tokenizer (text and
chat), incremental detokenizer, vocabulary size, context length, EOS ids.
Without a model directory only token-id prompts are accepted."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.errors import FailedPreconditionError, InvalidRequestError

from .text import Detokenizer

UNLIMITED = 2**31 - 1


class _NoText:
    """Detokenizer for a router without a tokenizer: token ids only, no text."""

    def add(self, token_ids: Sequence[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class ModelInfo:
    name: str = ""
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
            name=str(model_dir),
            vocab_size=config.vocab_size,
            max_model_len=config.max_position_embeddings,
            eos_token_ids=eos,
            tokenizer=tokenizer,
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
