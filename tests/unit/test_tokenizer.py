"""Tokenizer wrapper: round trip, special ids, chat templates, incremental detokenization of
multi-byte text with a byte-level BPE."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.errors import ModelLoadError
from pdserve.model.tokenizer import ChatTemplateError, Tokenizer

from .model_fixtures import tiny_checkpoint

TEXTS = [
    "The harbor master bought a whole loaf.",
    "Élodie ouvre son café à six heures — naïve façade, Dvořák, Łódź.",
    "海边的小镇 山の上の宿 작은 도서관",
    "Good morning ☀️ bread 🍞 coffee ☕ cat 🐈 asleep 😴 🎂🎉 👩‍👩‍👧",
    "   spaces\tand\nnewlines  ",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tok") / "m", vocab=700)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 0
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_special_ids(tok):
    assert tok.eos_token_ids[0] == 1 and tok.token_to_id("<|end|>") in tok.eos_token_ids
    assert tok.decode([0, 1, 4], skip_special_tokens=False) == "<|bos|><|eos|><|user|>"
    assert tok.decode([0, 1, 4]) == ""


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    det = tok.detokenizer()
    deltas = [det.add(i) for i in ids]
    deltas.append(det.flush())
    assert "".join(deltas) == text == det.text
    assert all("\ufffd" not in d for d in deltas)  # valid text: no replacement anywhere


def test_detokenizer_holds_back_split_characters(tok):
    """The emoji/CJK text really does split characters across tokens, and the detokenizer
    emits nothing for the tokens that end mid-character."""
    text = TEXTS[3] + TEXTS[2]
    ids = tok.encode(text, add_special_tokens=False)
    partial = [i for i in ids if tok.decode([i]).endswith("\ufffd")]
    assert partial, "test text should contain multi-byte characters split across tokens"
    det = tok.detokenizer()
    held = 0
    for i in ids:
        d = det.add(i)
        held += d == ""
        assert text.startswith(det.text)
    assert held >= 1 and det.text + det.flush() == text
    # several ids at once, and an incomplete tail flushed at the end
    det = tok.detokenizer()
    head = tok.encode("🍞", add_special_tokens=False)
    assert len(head) > 1
    assert det.add(head[:-1]) == ""
    assert det.flush() == "\ufffd" == tok.decode(head[:-1])  # cut off: ends the text as U+FFFD


def _stream(tok, ids, sizes) -> list[str]:
    """Deltas of `ids` fed in chunks of the given sizes (cycled), then the flush."""
    det, deltas, i, k = tok.detokenizer(), [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        deltas.append(det.add(ids[i : i + n]))
        i, k = i + n, k + 1
    deltas.append(det.flush())
    assert "".join(deltas) == det.text
    return deltas


def test_invalid_utf8_rule(tok):
    """The one rule for bytes that are not UTF-8 (docs/HTTP_API.md, "Text"): U+FFFD followed
    by text is final and sent; a trailing U+FFFD is held back while streaming (the next token
    may complete the character) and flushed as U+FFFD at the end."""
    from pdserve.model.tokenizer import detokenize

    lead = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
    assert lead, "the vocabulary should have tokens ending mid-character"
    word = tok.encode(" harbor", add_special_tokens=False)
    det = tok.detokenizer()
    assert det.add(lead[0]) == ""  # may be the start of a character: held
    middle = det.add(word)
    assert middle.startswith("\ufffd") and middle.endswith("harbor")  # it never completed
    assert det.flush() == ""
    det = tok.detokenizer()
    assert det.add(word) == " harbor" and det.add(lead[0]) == ""
    assert det.flush() == "\ufffd"  # cut off at the end of the stream
    ids = [*word, lead[0], *word, lead[0]]
    assert detokenize(tok, ids) == tok.decode(ids) == " harbor\ufffd harbor\ufffd"


def test_streamed_text_is_the_decoded_text_for_any_tokens(tok):
    """Any token sequence, valid UTF-8 or not, fed in any chunking: the deltas concatenate
    to tokenizer.decode(ids), and no delta before the flush ends in U+FFFD."""
    import random

    from pdserve.model.tokenizer import detokenize

    rng = random.Random(0)
    with_fffd = 0
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        whole = tok.decode(ids)
        with_fffd += "\ufffd" in whole
        assert detokenize(tok, ids) == whole
        for sizes in ([1], [2, 1, 3], [len(ids)]):
            deltas = _stream(tok, ids, sizes)
            assert "".join(deltas) == whole, (ids, sizes)
            assert not any(d.endswith("\ufffd") for d in deltas[:-1]), (ids, sizes)
    assert with_fffd > 20, "random ids should often be invalid UTF-8"


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🍞"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi 🍞<|end|>\n<|assistant|>\n"
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith(
        "<|assistant|>\n"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 0 and ids.count(tok.token_to_id("<|end|>")) == 2
    with pytest.raises(ChatTemplateError, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_forms_and_fallback(tok_dir, tmp_path):
    d = shutil.copytree(tok_dir, tmp_path / "m")
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "{{ messages[0]['content'] | tojson }}"},
    ]
    cfg_path.write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "é"}]) == '"é"'
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "[user]"
    (d / "chat_template.jinja").unlink()
    fallback = Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    assert fallback == "<|bos|><|user|>\nx\n<|assistant|>\n"


def test_sandbox_blocks_unsafe_template(tok_dir, tmp_path):
    d = shutil.copytree(tok_dir, tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages.__class__.__mro__ }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer(tmp_path):
    with pytest.raises(ModelLoadError, match=r"missing tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
