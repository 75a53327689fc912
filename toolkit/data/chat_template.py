"""A model's chat template, rendered with jinja2 as transformers renders it, and the tokens each turn trains.

``--chat-template T`` names a Hugging Face tokenizer folder (its ``chat_template.jinja``, else the
``chat_template`` of its ``tokenizer_config.json``), a ``tokenizer_config.json`` or a ``.jinja`` file. The
template runs in the environment ``transformers.apply_chat_template`` builds: a sandbox with ``trim_blocks``
and ``lstrip_blocks``, loop controls, the ``{% generation %}`` tag, ``tojson`` without HTML escaping,
``raise_exception``, ``strftime_now``, and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...)
as variables; messages lose their ``None`` values and their reasoning is offered under every name templates
read it by (``reasoning_content``, ``thinking``), as transformers does. The rendered text is encoded as
``apply_chat_template(tokenize=True)`` encodes it: the tokenizer without its own special tokens added.

Which tokens are trained (``--train-on``):

* ``assistant``: where the template marks ``{% generation %}`` spans, the tokens overlapping them
  (``return_assistant_tokens_mask``'s rule). A template without marks has each assistant turn found by
  rendering the conversation's prefixes: the turn is what rendering the messages through it adds to the
  messages before it with the generation prompt, so a template without marks still masks right. A template
  that renders an earlier turn differently once later messages follow (one that drops past reasoning) has
  no such prefix: the record is refused, and marks in the template are the way to train on it.
* ``last-assistant``: the same, only from the last assistant turn on.
* ``all``: every token.

A record the template cannot render, whose turns prefixes cannot find, with an empty assistant turn, no
assistant turn or no trained token is a :class:`SkippedRecord`: counted and named by the caller, never
trained on.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence, Tuple

from toolkit.core.errors import UserError, import_optional

TRAIN_ON = ("assistant", "last-assistant", "all")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TEMPLATE_FILE = "chat_template.jinja"

Span = Tuple[int, int]


class SkippedRecord(Exception):
    """A conversation that is not trained on; ``kind`` is what the report counts it under."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


#: what transformers appends to the final message to find where its continuation starts
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "

# the kinds of skipped records, as reported
CANNOT_RENDER = "the template cannot render it"
NO_PREFIX = "its turns cannot be found by prefix rendering"
EMPTY_TURN = "an empty assistant turn"
NO_ASSISTANT = "no assistant turn"
NO_TRAINED = "no trained token"
NOT_MESSAGES = "not a list of messages"


def _jinja2():
    return import_optional(
        "jinja2", "--chat-template: rendering a chat template needs jinja2; install it with: pip install jinja2"
    )


def _template_from_config(path: str) -> Optional[str]:
    from toolkit.core.errors import read_json_object

    value = read_json_object(path, "give a tokenizer_config.json saved by transformers").get("chat_template")
    if isinstance(value, list):  # several named templates: transformers uses "default"
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        if "default" not in named:
            raise UserError(
                f"{path}: holds the chat templates {', '.join(map(str, named))} and no 'default'; give the one to "
                f"use as a .jinja file (--chat-template FILE.jinja)"
            )
        value = named["default"]
    if value is not None and not isinstance(value, str):
        raise UserError(f"{path}: chat_template is a {type(value).__name__}, not a template; save the tokenizer again")
    return value


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def locate(spec: str, fallback_tokenizer: Optional[str] = None) -> Tuple[str, str, str]:
    """``(template text, where it was read, tokenizer folder)`` of ``--chat-template spec``."""
    flag = f"--chat-template {spec}"
    if os.path.isdir(spec):
        jinja_path, config_path = os.path.join(spec, TEMPLATE_FILE), os.path.join(spec, "tokenizer_config.json")
        if os.path.isfile(jinja_path):
            return _read_text(jinja_path), jinja_path, spec
        text = _template_from_config(config_path) if os.path.isfile(config_path) else None
        if text is None:
            raise UserError(
                f"{flag}: the folder has no {TEMPLATE_FILE} and no chat_template in tokenizer_config.json; "
                f"give the model's tokenizer folder or a .jinja file"
            )
        return text, config_path, spec
    if not os.path.isfile(spec):
        raise UserError(f"{flag}: no such file or folder; give a tokenizer folder, a tokenizer_config.json or a .jinja")
    folder = os.path.dirname(os.path.abspath(spec))
    if spec.endswith(".json"):
        text = _template_from_config(spec)
        if text is None:
            raise UserError(f"{flag}: has no chat_template; give the tokenizer_config.json of a chat model")
    else:
        text = _read_text(spec)
    if not _has_tokenizer(folder):
        if fallback_tokenizer is None or not _has_tokenizer(fallback_tokenizer):
            raise UserError(
                f"{flag}: no tokenizer beside it ({' or '.join(TOKENIZER_FILES)}) nor beside --srcdict; put the "
                f"template in the model's tokenizer folder or give --srcdict the dict.txt of an imported model"
            )
        folder = fallback_tokenizer
    return text, spec, folder


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--chat-template {path}: cannot be read ({e}); give a UTF-8 jinja file") from None


def _environment(jinja2):
    """transformers' sandbox for chat templates, with a ``{% generation %}`` tag that records where each
    span starts and ends in the text rendered so far (while a tracker is active)."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.tracking: ContextVar = ContextVar("generation_spans", default=None)
            environment.extend(track_generation=self.track)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_span", []), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            tracking = self.tracking.get()
            if tracking is not None:
                rendered, spans = tracking
                start = sum(len(block) for block in rendered)
                spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, rendered: List[str], spans: List[Span]):
            token = self.tracking.set((rendered, spans))
            try:
                yield
            finally:
                self.tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationSpans, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    return env


def normalized(messages: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Messages as transformers hands them to a template: ``None`` values dropped, reasoning under every name."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_NAMES if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@dataclass
class EncodedConversation:
    ids: List[int]
    mask: List[int]


class ChatTemplate:
    """A compiled template and the tokenizer it renders for; :meth:`encode` gives a record's ids and mask."""

    def __init__(self, text: str, source: str, tokenizer: Any, variables: Dict[str, Any], tokenizer_folder: str = ""):
        jinja2 = _jinja2()
        self.text, self.source, self.tokenizer, self.variables = text, source, tokenizer, dict(variables)
        self.tokenizer_folder = tokenizer_folder
        self.marks_generation = bool(GENERATION_TAG.search(text))
        try:
            self.template = _environment(jinja2).from_string(text)
        except jinja2.exceptions.TemplateError as e:
            raise UserError(f"--chat-template {source}: not a valid jinja template ({e})") from None

    @classmethod
    def load(cls, spec: str, fallback_tokenizer: Optional[str] = None) -> ChatTemplate:
        text, source, folder = locate(spec, fallback_tokenizer)
        transformers = import_optional(
            "transformers",
            "--chat-template: encoding with the model's tokenizer needs transformers; pip install transformers",
        )
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        except Exception as e:  # transformers raises many kinds for a damaged folder
            raise UserError(
                f"--chat-template {spec}: {folder} holds no tokenizer transformers can load ({e})"
            ) from None
        variables = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        return cls(text, source, tokenizer, variables, folder)

    def render(
        self, messages: Sequence[Dict[str, Any]], tools: Any = None, add_generation_prompt: bool = False
    ) -> Tuple[str, List[Span]]:
        """The text and its ``{% generation %}`` spans (character offsets)."""
        jinja2 = _jinja2()
        rendered: List[str] = []
        spans: List[Span] = []
        values = dict(self.variables, messages=messages, tools=tools, documents=None)
        values["add_generation_prompt"] = add_generation_prompt
        try:
            with self.template.environment.track_generation(rendered, spans):
                for block in self.template.generate(**values):
                    rendered.append(block)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise SkippedRecord(CANNOT_RENDER, f"{type(e).__name__}: {e}") from None
        return "".join(rendered), spans

    def prompt_text(self, messages: Sequence[Dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """``apply_chat_template(messages, tokenize=False, add_generation_prompt=..., continue_final_message=not
        add_generation_prompt)`` as transformers computes it: continuing, the text ends where the last message's
        content does (found by a tag appended to it; cut before the spacing the template trims). A template
        that cannot render the messages raises :class:`SkippedRecord`."""
        messages = normalized(messages)
        if not add_generation_prompt:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise SkippedRecord(CANNOT_RENDER, "no final message content to continue")
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}
        text, _ = self.render(messages, add_generation_prompt=add_generation_prompt)
        if add_generation_prompt:
            return text
        if CONTINUE_TAG.strip() not in text:
            raise SkippedRecord(CANNOT_RENDER, "the template drops the final message it is to continue")
        at = text.rindex(CONTINUE_TAG.strip())
        return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()

    def encode(self, messages: Any, tools: Any = None, train_on: str = "assistant") -> EncodedConversation:
        """The conversation's token ids and loss mask; :class:`SkippedRecord` for one not to train on."""
        messages = _checked_messages(messages)
        text, spans = self.render(messages, tools)
        if train_on != "all":
            spans = self._trained_spans(messages, tools, text, spans, train_on)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
        mask = [1] * len(ids) if train_on == "all" else tokens_overlapping(offsets, spans)
        if sum(mask[1:]) == 0:
            raise SkippedRecord(NO_TRAINED, f"{len(ids)} tokens, none trained after the first")
        return EncodedConversation(ids, mask)

    def _trained_spans(self, messages, tools, text: str, spans: List[Span], train_on: str) -> List[Span]:
        assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if not assistants:
            raise SkippedRecord(NO_ASSISTANT, f"roles {', '.join(str(m.get('role')) for m in messages)}")
        if not self.marks_generation:
            chosen = assistants[-1:] if train_on == "last-assistant" else assistants
            return [self._turn_by_prefixes(messages, tools, text, i) for i in chosen]
        if not spans or any(start == end for start, end in spans):
            raise SkippedRecord(EMPTY_TURN, "a {% generation %} span renders no text")
        if train_on == "last-assistant":
            start = self._turn_start(messages, tools, text, assistants[-1])
            spans = [span for span in spans if span[0] >= start]
        return spans

    def _turn_start(self, messages, tools, text: str, index: int) -> int:
        """Where assistant message ``index`` starts in ``text``: after the messages before it (with the
        generation prompt where that is a prefix of the text, else without)."""
        for prompt in (True, False):
            before, _ = self.render(messages[:index], tools, add_generation_prompt=prompt)
            if text.startswith(before):
                return len(before)
        raise SkippedRecord(NO_PREFIX, f"the messages before message {index} do not render as a prefix")

    def _turn_by_prefixes(self, messages, tools, text: str, index: int) -> Span:
        before, _ = self.render(messages[:index], tools, add_generation_prompt=True)
        through, _ = self.render(messages[: index + 1], tools)
        if not (through.startswith(before) and text.startswith(through)):
            raise SkippedRecord(
                NO_PREFIX,
                f"message {index} renders otherwise once later messages follow (or the generation prompt is no "
                f"prefix of it); add {{% generation %}} marks to the template",
            )
        if len(through) == len(before):
            raise SkippedRecord(EMPTY_TURN, f"message {index} adds no text")
        return len(before), len(through)


def _checked_messages(messages: Any) -> List[Dict[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not messages or not all(isinstance(m, dict) for m in messages):
        raise SkippedRecord(NOT_MESSAGES, f"got {type(messages).__name__}")
    messages = normalized(messages)
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and _is_empty(message):
            raise SkippedRecord(EMPTY_TURN, f"message {i} has no content and no tool calls")
    return messages


def _is_empty(message: Dict[str, Any]) -> bool:
    if message.get("tool_calls"):
        return False
    content = message.get("content")
    if isinstance(content, str):
        return not content.strip()
    return not content


def tokens_overlapping(offsets: Sequence[Tuple[int, int]], spans: Sequence[Span]) -> List[int]:
    """1 for each token whose characters overlap a span (spans and offsets in order), else 0: the rule
    ``apply_chat_template(return_assistant_tokens_mask=True)`` applies."""
    spans = sorted(spans)
    mask, k = [0] * len(offsets), 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask
