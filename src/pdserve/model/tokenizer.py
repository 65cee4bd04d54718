"""Tokenizer: tokenizer.json (via `tokenizers`) + chat template + incremental detokenizer.

Torch-free: the router imports it.

Chat template: `chat_template` from tokenizer_config.json (a string, or a list of
{"name", "template"} where "default" is used), else a `chat_template.jinja` file, rendered
in a jinja2 sandbox with HF's conventions (trim_blocks, lstrip_blocks, `raise_exception`,
`tojson`, `strftime_now`, bos_token / eos_token). Without any template, FALLBACK_TEMPLATE
is used: each message as "<|role|>\\n{content}\\n", then "<|assistant|>\\n" when
add_generation_prompt, prefixed by the bos token when the tokenizer has one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve.errors import ModelLoadError

FALLBACK_TEMPLATE = (
    "{{ bos_token or '' }}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(ValueError):
    """The template called raise_exception(...) or failed to render."""


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} (AddedToken form)
        return value.get("content")
    return value


class Tokenizer:
    def __init__(
        self,
        tokenizer: Any,  # tokenizers.Tokenizer
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._tok.token_to_id(bos_token) if bos_token else None
        ids = list(eos_token_ids)
        eos_id = self._tok.token_to_id(eos_token) if eos_token else None
        if eos_id is not None and eos_id not in ids:
            ids.insert(0, eos_id)
        self.eos_token_ids: list[int] = ids
        self._compiled: Any = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"missing tokenizer.json in {model_dir}")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise ModelLoadError(f"unreadable tokenizer.json: {exc}") from exc
        cfg = _read_json(model_dir / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        gen = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        eos_ids: list[int] = []
        for src in (model_cfg.get("eos_token_id"), gen.get("eos_token_id")):
            for v in src if isinstance(src, list) else [src]:
                if v is not None and int(v) not in eos_ids:
                    eos_ids.append(int(v))
        return cls(
            tok,
            chat_template=template,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            eos_token_ids=eos_ids,
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages ([{"role", "content"}]) to the prompt text. The result already
        holds any bos token, so encode it with add_special_tokens=False."""
        if self._compiled is None:
            self._compiled = _compile(self.chat_template or FALLBACK_TEMPLATE)
        try:
            return self._compiled.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except Exception as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


def _compile(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"unreadable {path.name}: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas: THE detokenizer of every path (the
    router's gRPC and HTTP doors, `pdserve generate --model` in process).

    The rule (docs/HTTP_API.md, "Text"): a request's text is `decode(all its tokens)`, with
    bytes that are not UTF-8 decoded to U+FFFD (one per maximal invalid subpart, as Python
    and Rust do). Streamed or not, the deltas concatenate to exactly that text:
    - while streaming, a trailing run of U+FFFD is held back: it may be a multi-byte
      character split across tokens, which the next token completes;
    - as soon as text follows it, a U+FFFD is final (bytes that can never complete, e.g. a
      lead byte followed by ASCII, or a stray continuation byte) and is sent;
    - at the end of the stream (`flush`), what is held is sent as decoded: an incomplete
      character cut off by max_tokens or a stop ends the text as U+FFFD.
    A delta returned by `add` therefore never ends in U+FFFD; only `flush`'s may.

    Keeps two offsets into the ids: text of ids[prefix:read] was already emitted; each step
    decodes ids[prefix:] and emits what lies beyond the prefix text. `prefix` only moves to
    a point where the decoded text ended on a complete character, so decoding from it (not
    from 0: each step is O(window)) gives the same characters as decoding everything."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""  # everything emitted so far

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Append token(s); return the new final text (possibly "")."""
        self.ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read], self._skip)
        full = self._tok.decode(self.ids[self._prefix :], self._skip)
        if len(full) <= len(prefix_text) or full.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or it may end mid-character: hold it back
        delta = full[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: emit what is held back, an incomplete character as U+FFFD."""
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read], self._skip)
        full = self._tok.decode(self.ids[self._prefix :], self._skip)
        delta = full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


def detokenize(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """A whole request's text by the streaming rule (equal to tokenizer.decode(token_ids))."""
    detok = tokenizer.detokenizer()
    detok.add(token_ids)
    detok.flush()
    return detok.text
