"""load_tokenizer against transformers' fast tokenizer on the same directory.

tandem's tokenizer must give the same ids, the same text and the same chat prompts as
`PreTrainedTokenizerFast` on: the default model, the tokenizers rebuilt from tiny GGUF files
(through the real conversion path), and variants of those directories that exercise the config
rules (added-token overrides, missing and model-specific special tokens, legacy files, named
templates, clean-up, split special tokens). transformers is the reference here; the tokenizer
under test never imports it (checked in a subprocess).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tandem.loader.chat_template import ChatTemplateError
from tandem.loader.resolve import convert_gguf, resolve_model
from tandem.loader.tokenizer import Tokenizer, load_tokenizer, render_chat
from tests.support.tiny_gguf import Q, write_gguf

MODEL = "smollm2-135m"

TRICKY_TEXTS = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\n\n\n  indented",
    "a" * 300 + " " * 17 + "b\n\n\n\n",
    "naïve café — Ünïcödé ß ﬁ ǅ Ω≈ç√",
    "日本語のテキスト、中文字符，한국어",
    "🤖👨‍👩‍👧‍👦🏳️‍🌈 ok 👍🏽",
    "e\u0301 a\u200bb \u00a0nbsp\u3000ideographic",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y <|im_end|><|im_end|>",
    "<|im_ <|IM_START|> <|endoftext| |im_end|>",
    "<file_sep>path<filename>x.py<gh_stars>10",
    "12345 3.14159 1e-9 0x1F",
    "def f(x):\n    return x**2  # comment\n\t\tpass",
    "don't I'm we've they're it's . , ! ?",
]

SMOL_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  spaces  and\nnewlines\n"},
    ],
    [
        {"role": "user", "content": "Start"},
        {"role": "assistant", "content": "The answer is"},
    ],
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — in °C, <b>not</b> °F & co.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}

TOOL_CHAT = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "Weather in Tokyo and Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 9}'},
    {"role": "assistant", "content": "Tokyo is 21 °C, Zürich"},
]

# Qwen2.5's template (tools, tool calls and tool results in its Hermes format).
TOOL_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Every feature of transformers' environment at once: special-token and extra variables,
# namespace, loop controls, a generation block, tojson's options, dict(), strftime_now,
# reasoning aliases, list content, documents, and `trim` (continue_final_message's rstrip case).
KITCHEN_SINK_TEMPLATE = """{{ bos_token }}{% set ns = namespace(count=0) %}
{% for message in messages %}
{% if message.role == 'system' and not loop.first %}{{ raise_exception('System message must come first') }}{% endif %}
{% if message.role == 'skip' %}{% continue %}{% endif %}
{% if message.role == 'stop' %}{% break %}{% endif %}
{% set ns.count = ns.count + 1 %}
<{{ message.role }}>{% if message.reasoning_content %}[think]{{ message.reasoning_content }}[/think]{% endif %}
{% if message.thinking %}(thinking too){% endif %}
{% if message.content is string %}{{ message.content | trim }}{% else %}{% for part in message.content %}{{ part.text }}|{% endfor %}{% endif %}
{% for call in message.tool_calls or [] %}{% generation %}CALL {{ call.function | tojson(indent=2, sort_keys=true) }}{% endgeneration %}{% endfor %}
{{ eos_token }}
{% endfor %}
{% if tools %}TOOLS {{ tools | tojson(separators=(',', ':')) }}{% endif %}
{% for d in documents or [] %}DOC {{ d.title }}: {{ d.text }}
{% endfor %}
{% set extra = dict(a=1, b='<&>') %}{{ extra | tojson }} {{ 'é<>&\\'' | tojson }} {{ dict.fromkeys(['k']) | tojson }}
{% if image_token is defined %}IMG={{ image_token }}{% endif %} {% if custom_flag %}FLAG={{ custom_flag }}{% endif %}
{{ ns.count }} {{ strftime_now('%Y') }} {{ unk_token }} {{ pad_token }}
{% if add_generation_prompt %}<assistant>{% endif %}"""

DEFAULT_NAMED = "{% for m in messages %}[default]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
TOOL_USE_NAMED = "{% for m in messages %}[tool_use]{{ m.content }}{% endfor %}{{ tools | length }}"


# --- directories --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return resolve_model(MODEL, "float32", None).hf_dir


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tokenizers rebuilt from tiny GGUFs by the loader's conversion (qwen2 with a template)."""
    root = tmp_path_factory.mktemp("tiny-tok")
    out = {}
    for arch in ("llama", "qwen2"):
        (root / arch).mkdir()
        extra = (lambda writer: writer.add_chat_template(TOOL_TEMPLATE)) if arch == "qwen2" else None
        gguf = write_gguf(root / arch / f"tiny-{arch}.gguf", arch, Q.F32, extra_metadata=extra).path
        out[arch] = convert_gguf(gguf, "float32", root / "cache")
    return out


def _variant(base: Path, target: Path, config: dict[str, Any], files: dict[str, Any] | None = None) -> Path:
    """`base`'s tokenizer.json with another tokenizer_config.json (and extra files)."""
    target.mkdir(parents=True)
    shutil.copy(base / "tokenizer.json", target / "tokenizer.json")
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return target


@pytest.fixture(scope="module")
def variants(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    base = json.loads((smol_dir / "tokenizer_config.json").read_text())
    return {
        # Special tokens the vocabulary lacks, a model-specific one, extras, an added token
        # made non-special, add_bos/eos (which tokenizer.json's post-processor overrides).
        "overrides": _variant(smol_dir, root / "overrides", {
            **base,
            "chat_template": KITCHEN_SINK_TEMPLATE,
            "sep_token": "<|sep|>",
            "image_token": "<|image|>",
            "extra_special_tokens": ["<extra_a>", "<|im_start|>"],
            "added_tokens_decoder": {
                "5": {"content": "<file_sep>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": False},
                "2": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": False},
            },
            "add_bos_token": True,
            "add_eos_token": True,
            "clean_up_tokenization_spaces": True,
        }),
        # Older checkpoints: special_tokens_map.json and named templates in a list.
        "legacy": _variant(smol_dir, root / "legacy", {
            "model_max_length": 2048,
            "chat_template": [{"name": "default", "template": DEFAULT_NAMED},
                              {"name": "tool_use", "template": TOOL_USE_NAMED}],
        }, {
            "special_tokens_map.json": {
                "bos_token": {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False},
                "eos_token": "<|im_end|>",
                "mask_token": "<mask>",
                "additional_special_tokens": ["<repo_name>", "<reponame>"],
            },
        }),
        # Templates as files: chat_template.jinja plus additional_chat_templates/.
        "template_files": _variant(smol_dir, root / "template_files", {**base, "chat_template": "unused"}, {
            "chat_template.jinja": DEFAULT_NAMED,
            "additional_chat_templates/tool_use.jinja": TOOL_USE_NAMED,
        }),
        "split_special": _variant(smol_dir, root / "split_special", {**base, "split_special_tokens": True}),
    }


@pytest.fixture(scope="module")
def word_level_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A non-BPE tokenizer with clean_up_tokenization_spaces, where the clean-up applies."""
    target = tmp_path_factory.mktemp("word-level")
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", ",", "world", ".", "don", "'", "t", "?", "[SEP]"])}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    backend.save(str(target / "tokenizer.json"))
    config = {"unk_token": "[UNK]", "sep_token": "[SEP]", "clean_up_tokenization_spaces": True}
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def _pair(directory: Path) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    return load_tokenizer(directory), PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)


def _all_dirs(smol_dir: Path, tiny_dirs: dict[str, Path], variants: dict[str, Path],
              word_level_dir: Path) -> dict[str, Path]:
    return {"smollm2": smol_dir, **{f"tiny-{k}": v for k, v in tiny_dirs.items()}, **variants,
            "word_level": word_level_dir}


# --- encode / decode ----------------------------------------------------------------------


def test_encode_decode_match_transformers(smol_dir: Path, tiny_dirs: dict[str, Path], variants: dict[str, Path],
                                          word_level_dir: Path) -> None:
    texts = [*TRICKY_TEXTS, "a<|image|>b<|sep|>c<extra_a> <mask>", "hello , world . don ' t ?"]
    for name, directory in _all_dirs(smol_dir, tiny_dirs, variants, word_level_dir).items():
        ours, ref = _pair(directory)
        for text in texts:
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == ref.encode(text, add_special_tokens=special), (name, text, special)
                assert ours(text, add_special_tokens=special) == dict(ref(text, add_special_tokens=special))
                for skip in (True, False):
                    assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (
                        name, text, skip)
            assert ours.tokenize(text) == ref.tokenize(text), (name, text)
        assert ours(texts) == dict(ref(texts)), name


def test_decode_arbitrary_ids_and_partial_characters(smol_dir: Path, tiny_dirs: dict[str, Path],
                                                     variants: dict[str, Path], word_level_dir: Path) -> None:
    rng = random.Random(0)
    for name, directory in _all_dirs(smol_dir, tiny_dirs, variants, word_level_dir).items():
        ours, ref = _pair(directory)
        size = len(ref)
        sequences = [[rng.randrange(size) for _ in range(rng.randint(1, 40))] for _ in range(30)]
        emoji = ref.encode("🤖 é 中", add_special_tokens=False)
        sequences += [emoji[:cut] for cut in range(1, len(emoji) + 1)]  # partial UTF-8 → U+FFFD
        sequences += [[0, 1, 2], list(ref.all_special_ids), [size - 1]]
        for ids in sequences:
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), (
                    name, ids)
            assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == ref.convert_ids_to_tokens(
                ids, skip_special_tokens=True)
        assert ours.decode(sequences[0][0]) == ref.decode(sequences[0][0])
        assert ours.decode(sequences[:3]) == ref.decode(sequences[:3])
        assert ours.batch_decode(sequences[:3], skip_special_tokens=True) == ref.batch_decode(
            sequences[:3], skip_special_tokens=True)
        assert ours.decode(ids, clean_up_tokenization_spaces=False) == ref.decode(ids, clean_up_tokenization_spaces=False)


def test_vocabulary_and_special_tokens_match(smol_dir: Path, tiny_dirs: dict[str, Path], variants: dict[str, Path],
                                             word_level_dir: Path) -> None:
    for name, directory in _all_dirs(smol_dir, tiny_dirs, variants, word_level_dir).items():
        ours, ref = _pair(directory)
        assert (len(ours), ours.vocab_size) == (len(ref), ref.vocab_size), name
        assert ours.get_vocab() == ref.get_vocab(), name
        assert ours.added_tokens_decoder == ref.added_tokens_decoder, name
        assert ours.added_tokens_encoder == ref.added_tokens_encoder, name
        assert ours.special_tokens_map == ref.special_tokens_map, name
        assert ours.all_special_tokens == ref.all_special_tokens, name
        assert ours.all_special_ids == ref.all_special_ids, name
        for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
            assert getattr(ours, attr) == getattr(ref, attr), (name, attr)
            assert getattr(ours, attr + "_id") == getattr(ref, attr + "_id"), (name, attr)
        assert ours.convert_tokens_to_ids(["hello", "<|im_end|>", "not-a-token-at-all"]) == ref.convert_tokens_to_ids(
            ["hello", "<|im_end|>", "not-a-token-at-all"])
        tokens = ref.convert_ids_to_tokens(ref.encode("Hello, wörld 🤖", add_special_tokens=False))
        assert ours.convert_tokens_to_string(tokens) == ref.convert_tokens_to_string(tokens)
        assert ours.clean_up_tokenization_spaces == ref.clean_up_tokenization_spaces, name
        assert ours.chat_template == ref.chat_template, name
        assert ours.num_special_tokens_to_add() == ref.num_special_tokens_to_add()
    ours, ref = _pair(variants["overrides"])
    assert ours.image_token == ref.image_token == "<|image|>" and ours.image_token_id == ref.image_token_id
    assert ours.add_bos_token and ours.encode("hi") == ref.encode("hi") == [6004]  # post-processor decides


# --- chat templates -----------------------------------------------------------------------


def _render_both(ours: Tokenizer, ref: PreTrainedTokenizerFast, messages: list[dict[str, Any]],
                 **kwargs: Any) -> str:
    mine = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    theirs = ref.apply_chat_template(messages, tokenize=False, **kwargs)
    assert mine == theirs, kwargs
    return mine


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_default_model_chat_template(smol_dir: Path, tools: list[dict[str, Any]] | None) -> None:
    ours, ref = _pair(smol_dir)
    for messages in SMOL_CHATS:
        for generation_prompt in (True, False):
            _render_both(ours, ref, messages, tools=tools, add_generation_prompt=generation_prompt)
        ids = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        assert ids == dict(ref.apply_chat_template(messages, tools=tools, add_generation_prompt=True))
        assert ours.apply_chat_template(messages, return_dict=False) == ref.apply_chat_template(
            messages, return_dict=False)
    continued = _render_both(ours, ref, SMOL_CHATS[2], continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nThe answer is")
    assert render_chat(ours, SMOL_CHATS[1], tools=tools) == ref.apply_chat_template(
        SMOL_CHATS[1], tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(SMOL_CHATS, tokenize=False) == ref.apply_chat_template(SMOL_CHATS, tokenize=False)


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL], [WEATHER_TOOL, TIME_TOOL]])
def test_tool_template_with_tool_history(tiny_dirs: dict[str, Path], tools: list[dict[str, Any]] | None) -> None:
    ours, ref = _pair(tiny_dirs["qwen2"])
    assert ours.chat_template == TOOL_TEMPLATE
    for generation_prompt in (True, False):
        _render_both(ours, ref, TOOL_CHAT[:-1], tools=tools, add_generation_prompt=generation_prompt)
        _render_both(ours, ref, TOOL_CHAT[1:2], tools=tools, add_generation_prompt=generation_prompt)
    text = _render_both(ours, ref, TOOL_CHAT, tools=tools, continue_final_message=True)
    assert text.endswith("Tokyo is 21 °C, Zürich")
    assert ours.apply_chat_template(TOOL_CHAT, tools=tools) == dict(ref.apply_chat_template(TOOL_CHAT, tools=tools))
    if tools:
        assert '"description": "Weather for a city — in °C, <b>not</b> °F & co."' in text  # tojson, unescaped


def test_every_template_feature(variants: dict[str, Path]) -> None:
    ours, ref = _pair(variants["overrides"])
    messages = [
        {"role": "system", "content": "Be brief.  "},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "image"},
                                     {"type": "text", "text": "part two"}]},
        {"role": "skip", "content": "never shown"},
        {"role": "assistant", "content": "  ok  ", "reasoning": "hmm",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [1, "é"]}}}]},
        {"role": "user", "content": "again", "name": None},
        {"role": "stop", "content": "after the break"},
    ]
    documents = [{"title": "Doc <1>", "text": "Body & more"}]
    for generation_prompt in (True, False):
        text = _render_both(ours, ref, messages, tools=[WEATHER_TOOL], documents=documents,
                            add_generation_prompt=generation_prompt, custom_flag="on")
    assert "IMG=<|image|>" in text and "FLAG=on" in text and "[think]hmm[/think]" in text
    assert '"é<>&\'"' in text and "never shown" not in text and "after the break" not in text
    continued = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "trailing spaces   "},  # `trim` eats the marker's space
    ]
    assert _render_both(ours, ref, continued, continue_final_message=True).endswith("trailing spaces")
    blocks = [{"role": "user", "content": "q"},
              {"role": "assistant", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "last"}]}]
    assert _render_both(ours, ref, blocks, continue_final_message=True).endswith("first|last")
    reasoning = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "because"}]
    assert _render_both(ours, ref, reasoning, continue_final_message="reasoning_content").endswith("[think]because")


def test_named_templates_from_config_and_files(variants: dict[str, Path]) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for name in ("legacy", "template_files"):
        ours, ref = _pair(variants[name])
        assert ours.chat_template == ref.chat_template == {"default": DEFAULT_NAMED, "tool_use": TOOL_USE_NAMED}
        assert _render_both(ours, ref, messages, add_generation_prompt=True) == "[default]hi>"
        assert _render_both(ours, ref, messages, tools=[WEATHER_TOOL]) == "[tool_use]hi1"
        assert _render_both(ours, ref, messages, chat_template="tool_use", tools=[]) == "[tool_use]hi0"
        explicit = "{{ messages[0].content | upper }}"
        assert _render_both(ours, ref, messages, chat_template=explicit) == "HI"
    assert load_tokenizer(variants["legacy"]).model_max_length == 2048


def test_chat_template_json_is_a_fallback(smol_dir: Path, tmp_path: Path) -> None:
    """A processor's chat_template.json, which transformers' tokenizer ignores, is used when
    there is no other template; it renders as transformers renders that template."""
    config = json.loads((smol_dir / "tokenizer_config.json").read_text())
    directory = _variant(smol_dir, tmp_path / "d", config, {"chat_template.json": {"chat_template": TOOL_TEMPLATE}})
    ours, ref = _pair(directory)
    assert ref.chat_template is None and ours.chat_template == TOOL_TEMPLATE
    assert ours.apply_chat_template(TOOL_CHAT[:-1], tools=[WEATHER_TOOL], tokenize=False) == ref.apply_chat_template(
        TOOL_CHAT[:-1], tools=[WEATHER_TOOL], tokenize=False, chat_template=TOOL_TEMPLATE)


# --- errors -------------------------------------------------------------------------------


def test_raise_exception_is_a_clear_value_error(variants: dict[str, Path]) -> None:
    ours = load_tokenizer(variants["overrides"])
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(ValueError, match="^System message must come first$") as info:
        ours.apply_chat_template(messages, tokenize=False)
    assert isinstance(info.value, (ChatTemplateError, jinja2.TemplateError))
    with pytest.raises(ValueError, match="System message must come first"):
        render_chat(ours, messages)


def test_chat_errors_match_transformers_cases(smol_dir: Path, tiny_dirs: dict[str, Path]) -> None:
    ours, ref = _pair(smol_dir)
    user = [{"role": "user", "content": "hi"}]
    for call in (
        lambda tok: tok.apply_chat_template([], tokenize=False),
        lambda tok: tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True,
                                            continue_final_message=True),
        lambda tok: tok.apply_chat_template([{"role": "assistant", "content": None}], tokenize=False,
                                            continue_final_message=True),
    ):
        with pytest.raises(ValueError):
            call(ref)
        with pytest.raises(ValueError):
            call(ours)
    with pytest.raises(ValueError, match="non-empty"):
        render_chat(ours, [])
    no_template = load_tokenizer(tiny_dirs["llama"])
    assert no_template.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(no_template, user)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template(user, tokenize=False)
    with pytest.raises(NotImplementedError, match="return_tensors"):
        ours.apply_chat_template(user, return_tensors="pt")


def test_directory_without_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(FileNotFoundError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)


def test_slow_files_only_go_through_transformers(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """No tokenizer.json (vocab.json + merges.txt): transformers converts, results unchanged."""
    from transformers import AutoTokenizer

    source = json.loads((tiny_dirs["qwen2"] / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(source["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in source["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = json.loads((tiny_dirs["qwen2"] / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    ours, ref = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in TRICKY_TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_id == ref.eos_token_id
    _render_both(ours, ref, TOOL_CHAT[:-1], tools=[WEATHER_TOOL], add_generation_prompt=True)


def test_loading_and_rendering_import_no_torch(smol_dir: Path) -> None:
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tandem.loader.tokenizer import load_tokenizer, render_chat\n"
        f"tok = load_tokenizer(Path({str(smol_dir)!r}))\n"
        "text = render_chat(tok, [{'role': 'user', 'content': 'hi'}])\n"
        "tok.decode(tok.encode(text), skip_special_tokens=True)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
