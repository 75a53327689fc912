"""Chat templates rendered as transformers renders them, and the tokens each --train-on choice trains.

A ChatML template with tools, tool calls and reasoning: our ids and masks equal ``apply_chat_template(...,
return_assistant_tokens_mask=True)``'s with its {% generation %} marks, and prefix rendering without the marks
gives the same masks; a template that drops past reasoning, one that raises, and empty turns are skipped by kind.
"""

import sys

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from tests.helpers.hf_llama import save_tokenizer  # noqa: E402
from toolkit.core.errors import UserError  # noqa: E402
from toolkit.data import chat_template as C  # noqa: E402

CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.reasoning_content %}{{- '<think> ' + message.reasoning_content + ' </think> ' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}{{- ' <tool_call> ' + (call.function | tojson) }}{%- endfor %}"
    "{{- ' <|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + ' <|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
UNMARKED = CHATML.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4", "tool_calls": None}],
    [
        {"role": "system", "content": "w5"},
        {"role": "user", "content": "w6"},
        {"role": "assistant", "content": "w7", "reasoning_content": "w8 w9"},
        {"role": "user", "content": "w10"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "lookup", "arguments": {}}}]},
        {"role": "tool", "content": "w11"},
        {"role": "assistant", "content": "w12 w13"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tokenizer(str(folder), "llama", chat_template=CHATML)
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def ours(tokenizer, text=CHATML):
    return C.ChatTemplate(text, "test", tokenizer, dict(tokenizer.special_tokens_map))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_ids_and_masks_are_transformers_with_marks_and_by_prefixes_without(tokenizer, messages):
    want = tokenizer.apply_chat_template(messages, tools=TOOLS, return_dict=True, return_assistant_tokens_mask=True)
    assert sum(want["assistant_masks"]) > 0
    for text in (CHATML, UNMARKED):
        got = ours(tokenizer, text).encode(messages, TOOLS)
        assert (got.ids, got.mask) == (list(want["input_ids"]), list(want["assistant_masks"])), text[:40]


def test_last_assistant_and_all(tokenizer):
    messages = CONVERSATIONS[1]
    every = ours(tokenizer).encode(messages).mask
    for text in (CHATML, UNMARKED):
        last = ours(tokenizer, text).encode(messages, train_on="last-assistant").mask
        start = len(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)["input_ids"])
        assert last == [0] * start + every[start:] and sum(last) == 3  # w12 w13 <|im_end|>
    assert ours(tokenizer).encode(messages, train_on="all").mask == [1] * len(every)


def test_records_not_to_train_on_are_skipped_by_kind(tokenizer):
    user = {"role": "user", "content": "w1"}
    cases = [
        (CHATML, [user, {"role": "assistant", "content": "  "}], C.EMPTY_TURN),
        (CHATML, [user], C.NO_ASSISTANT),
        (CHATML, "w1", C.NOT_MESSAGES),
        ("{{ raise_exception('no system role') }}", [user, {"role": "assistant", "content": "w2"}], C.CANNOT_RENDER),
        (
            UNMARKED.replace("message.reasoning_content %}", "message.reasoning_content and loop.last %}"),
            [user, {"role": "assistant", "content": "w2", "reasoning_content": "w3"}, user, CONVERSATIONS[0][1]],
            C.NO_PREFIX,
        ),
    ]
    for text, messages, kind in cases:
        with pytest.raises(C.SkippedRecord) as caught:
            ours(tokenizer, text).encode(messages)
        assert caught.value.kind == kind


def test_tokens_overlapping_a_span():
    offsets = [(0, 3), (3, 5), (6, 9), (9, 10), (11, 14)]
    assert C.tokens_overlapping(offsets, [(4, 7), (13, 20)]) == [0, 1, 1, 0, 1]
    assert C.tokens_overlapping(offsets, []) == [0] * 5


def test_locating_the_template_and_missing_jinja2(tmp_path, tokenizer, monkeypatch):
    tokenizer.save_pretrained(tmp_path / "tok")
    text, source, folder = C.locate(str(tmp_path / "tok"))
    assert text == CHATML and source.endswith("chat_template.jinja") and folder == str(tmp_path / "tok")
    (tmp_path / "lone.jinja").write_text(UNMARKED)
    with pytest.raises(UserError, match="no tokenizer beside it"):
        C.locate(str(tmp_path / "lone.jinja"))
    assert C.locate(str(tmp_path / "lone.jinja"), str(tmp_path / "tok"))[2] == str(tmp_path / "tok")
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(UserError, match="pip install jinja2"):
        ours(tokenizer)


@pytest.mark.parametrize("trailing", ["", " "])
def test_prompt_text_is_transformers_with_the_generation_prompt_or_continuing(tokenizer, trailing):
    """lm_eval's contexts: ``apply_chat_template(tokenize=False)`` with the generation prompt, or continuing the
    final (assistant) message, cut where its content ends (a trailing space the template keeps, or trims)."""
    template = ours(tokenizer)
    for messages in CONVERSATIONS:
        asked = messages[:-1]
        want = tokenizer.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
        assert template.prompt_text(asked, add_generation_prompt=True) == want
    started = [*CONVERSATIONS[0][:1], {"role": "assistant", "content": "w3" + trailing}]
    want = tokenizer.apply_chat_template(started, tokenize=False, continue_final_message=True)
    assert template.prompt_text(started, add_generation_prompt=False) == want and want.rstrip().endswith(
        "assistant\nw3"
    )
