"""Rendering and tokenization: text with the character spans that carry loss, then tokens and labels.

Rendering goes through the tokenizer's chat template; the trained character spans are found by
rendering conversation prefixes, and the full text is tokenized once with offsets so that labels
are exact (IGNORE_INDEX everywhere outside the trained spans).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from finetune.data import formats
from finetune.data.formats import BadRow
from finetune.errors import DataError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the label of positions that carry no loss (torch CrossEntropyLoss ignore_index)
_TOKENIZE_CHUNK = 1000


@dataclass
class Rendered:
    text: str
    spans: list[tuple[int, int]]  # sorted, non-overlapping [start, end) character ranges


def tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


class Renderer:
    """Turns validated rows of one format into text with trained spans, as its record's `renders` says
    (finetune/data/formats.py): a text as it is; a (prompt, answer) pair as plain text, or as a user and an
    assistant turn through the chat template; a conversation through the chat template."""

    def __init__(self, tokenizer, fmt: str, cfg, path: str):
        self.tokenizer, self.fmt, self.path = tokenizer, fmt, path
        self.format = formats.TABLE[fmt]
        renders = self.format.renders
        self.train_on_prompt = bool(getattr(cfg, "train_on_prompt", False))
        self.system_prompt = getattr(cfg, "system_prompt", None)
        specials = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        specials |= set(tokenizer.all_special_tokens)
        # longest first, so '<|im_start|>' is named rather than a special token it contains
        self.specials = (
            re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) if specials else None
        )
        use_template = bool(getattr(cfg, "chat_template", True))
        self.plain = renders == "text" or (renders == "pair" and not use_template)
        if self.plain:
            self._check_plain_tokens()
            if self.system_prompt and renders != "text":
                logger.warning("data.system_prompt is ignored because data.chat_template is false")
        else:
            self._check_chat_template(use_template)

    def _check_chat_template(self, use_template: bool) -> None:
        if getattr(self.tokenizer, "chat_template", None):
            return
        name = tokenizer_name(self.tokenizer)
        if self.format.renders == "pair":
            fix = "set data.chat_template: false to train on plain prompt + completion text, or use a model with a chat template"
        else:
            fix = f"{self.fmt} data needs a chat template: use a model whose tokenizer has one"
        raise DataError(f"tokenizer {name!r} has no chat template; {fix}", path=self.path)

    def _check_plain_tokens(self) -> None:
        if not self.tokenizer.eos_token:
            raise DataError(
                f"tokenizer {tokenizer_name(self.tokenizer)!r} has no eos_token to end plain-text examples with",
                path=self.path,
            )
        # Tokenization below uses add_special_tokens=False so that offsets match the text;
        # keep the BOS that this tokenizer would normally add by writing it into the text.
        bos_id = self.tokenizer.bos_token_id
        ids = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        self.bos = self.tokenizer.bos_token if bos_id is not None and ids[:1] == [bos_id] else ""

    def check_text(self, field: str, text: str) -> None:
        """A special token typed inside the data would be tokenized as the control token itself (a turn
        boundary, an end of text): refused with the row (docs/data.md "Special tokens in the text")."""
        found = self.specials.search(text) if self.specials and text else None
        if found:
            raise BadRow(
                f"{field} contains {found.group()!r}, a special token of tokenizer {tokenizer_name(self.tokenizer)!r}: "
                "it would be trained as that control token (e.g. a turn boundary), not as text. Remove or rewrite "
                "it in the data (e.g. with a space inside it), or set data.on_bad_rows: skip to leave such rows out"
            )

    def render(self, row: dict) -> Rendered:
        rendered = self._render(row)
        for text in self.format.texts:
            key, _, field = text.partition("[].")
            if field:  # that field of every turn in the list
                for i, turn in enumerate(row[key]):
                    self.check_text(f"{key}[{i}].{field}", turn[field])
            else:
                self.check_text(repr(key), row.get(key) or "")
        return rendered

    def _render(self, row: dict) -> Rendered:
        valid = self.format.validate(row)
        if self.format.renders == "text":
            text = self.bos + valid + self.tokenizer.eos_token
            return Rendered(text, [(0, len(text))])
        if self.format.renders == "pair":
            prompt, completion = valid
            if self.plain:
                head = self.bos + prompt
                text = head + completion + self.tokenizer.eos_token
                start = 0 if self.train_on_prompt else len(head)
                return Rendered(text, [(start, len(text))])
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        else:
            messages = valid
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return self._render_chat(messages)

    def _apply(self, messages: list[dict], *, generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raises for conversations the template refuses
            raise BadRow(f"the chat template rejected this conversation: {type(e).__name__}: {e}") from None

    def _render_chat(self, messages: list[dict]) -> Rendered:
        full = self._apply(messages)
        if self.train_on_prompt:
            return Rendered(full, [(0, len(full))])
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            # The trained span is what the template adds for this assistant turn beyond the
            # generation prompt: the content plus its end-of-turn text, so the model learns to stop.
            before = self._apply(messages[:i], generation_prompt=True)
            through = full if i == len(messages) - 1 else self._apply(messages[: i + 1])
            if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
                raise TemplateNotPrefixStable(i)
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return Rendered(full, spans)


class TemplateNotPrefixStable(Exception):
    """Raised per row but reported as a configuration problem: it is the template, not the data."""

    def __init__(self, turn: int):
        super().__init__(turn)
        self.turn = turn


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


def _mask(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Labels are the token ids whose character range lies inside a trained span."""
    labels = [IGNORE_INDEX] * len(ids)
    j = 0
    for t, (start, end) in enumerate(offsets):
        while j < len(spans) and spans[j][1] < end:
            j += 1
        if j < len(spans) and spans[j][0] <= start and end <= spans[j][1]:
            labels[t] = ids[t]
    return labels


def tokenize(rendered: list[Rendered], tokenizer, interrupt=None) -> list[Example]:
    """Each text tokenized once, with offsets, in chunks; `interrupt()` is called per chunk."""
    examples = []
    for lo in range(0, len(rendered), _TOKENIZE_CHUNK):
        if interrupt is not None:
            interrupt()
        chunk = rendered[lo : lo + _TOKENIZE_CHUNK]
        try:
            enc = tokenizer([r.text for r in chunk], add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:
            raise DataError(
                f"tokenizer {tokenizer_name(tokenizer)!r} cannot return character offsets; "
                "a fast (Rust) tokenizer is needed for exact label masks"
            ) from None
        for r, ids, offsets in zip(chunk, enc["input_ids"], enc["offset_mapping"]):
            examples.append(Example(list(ids), _mask(ids, offsets, r.spans)))
    return examples
