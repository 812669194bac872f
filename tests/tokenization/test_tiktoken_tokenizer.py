"""Kimi's tiktoken tokenizer (tiktoken.model + tokenizer_config.json), loaded without its code.

The real 163,584-token file cannot be had offline, so the module builds a Kimi-shaped
directory: a byte-level BPE trained here on a varied corpus (split by Kimi's pattern) and
padded to Kimi's exact size with tokens made of bytes that never occur in UTF-8 text, written
as `base64 rank` lines; K2.5's tokenizer_config.json special tokens at their real ids
(163584 [BOS] ... 163839 [PAD], the rest reserved); and K2.5's chat template. The reference is
tiktoken itself, set up the way Kimi's tokenization_kimi.py sets it up (its own copy of the split
pattern and special tokens, not tandem's).
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from itertools import product
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Regex, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend
from tokenizers import models as bpe_models

from tandem.edge.openai_protocol import ChatMessage, Tool
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.loader.tokenizer import Tokenizer, load_tokenizer
from tandem.server.chat_prompt import render_chat_prompt
from tandem.server.tool_parsers import KimiK2ToolParser, detect_tool_parser
from tandem.structured.constraints import GrammarConstraints, TokenizerSource, mask_allows
from tandem.tokenization import tiktoken_tokenizer
from tandem.types import GuidedDecoding, Request, SamplingParams

BASE = 163_584  # Kimi's BPE tokens; its special tokens are the 256 ids from here
VOCAB = BASE + 256

# tokenization_kimi.py's `pat_str`, as Kimi's remote code writes it (the reference's own copy).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# moonshotai/Kimi-K2.5's tokenizer_config.json: its added tokens (id: text, special), the
# other ids up to 163839 being <|reserved_token_ID|> in tokenization_kimi.py.
KIMI_ADDED = {
    163584: ("[BOS]", True), 163585: ("[EOS]", True), 163586: ("<|im_end|>", True),
    163587: ("<|im_user|>", True), 163588: ("<|im_assistant|>", True),
    163590: ("<|start_header_id|>", True), 163591: ("<|end_header_id|>", True), 163593: ("[EOT]", True),
    163594: ("<|im_system|>", True), 163595: ("<|tool_calls_section_begin|>", False),
    163596: ("<|tool_calls_section_end|>", False), 163597: ("<|tool_call_begin|>", False),
    163598: ("<|tool_call_argument_begin|>", False), 163599: ("<|tool_call_end|>", False),
    163601: ("<|im_middle|>", True), 163602: ("<|media_begin|>", True), 163603: ("<|media_content|>", True),
    163604: ("<|media_end|>", True), 163605: ("<|media_pad|>", True), 163606: ("<think>", False),
    163607: ("</think>", False), 163838: ("[UNK]", True), 163839: ("[PAD]", True),
}
KIMI_CONFIG = {
    "added_tokens_decoder": {
        str(index): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": special}
        for index, (text, special) in KIMI_ADDED.items()
    },
    "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                  "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>",
                                  "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"],
    "bos_token": "[BOS]",
    "clean_up_tokenization_spaces": False,
    "eos_token": "[EOS]",
    "extra_special_tokens": {},
    "model_max_length": 1000000000000000019884624838656,
    "pad_token": "[PAD]",
    "tokenizer_class": "TikTokenTokenizer",
    "unk_token": "[UNK]",
    "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
}
IM_END = 163586

# moonshotai/Kimi-K2.5's chat template (chat_template.jinja in the model repository): model
# data, like a config.json, reproduced from public copies (Kimi-K2-Thinking's published template
# and checkouts derived from K2.5's, which add K2.5's media tokens and the `tools_ts_str`
# branch). Tools are declared in a tool_declare system turn (in the TypeScript form only when
# the caller computes `tools_ts_str`, else as compact JSON), calls are written with the ids the
# conversation carries, results headed "## Return of ID", and thinking is on unless the
# `thinking` variable is false.
KIMI_K25_TEMPLATE = """{%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}
      {{ c }}
    {%- elif c is not none -%}
      {% for content in c -%}
        {% if content['type'] == 'image' or content['type'] == 'image_url' -%}
          <|media_begin|>image<|media_content|><|media_pad|><|media_end|>
        {% elif content['type'] == 'video' or content['type']== 'video_url'-%}
          <|kimi_k25_video_placeholder|>
        {% else -%}
          {{ content['text'] }}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{% macro set_roles(message) -%}
  {%- set role_name =  message.get('name') or  message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}
    <|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}


{%- macro render_toolcalls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tool_call in message['tool_calls'] -%}
    {%- set formatted_id = tool_call['id'] -%}
    <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}


{# Find last non-tool-call assisitant message #}
{%- set ns = namespace(last_non_tool_call_assistant_msg=-1) -%}
{%- for idx in range(messages|length-1, -1, -1) -%}
    {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') -%}
        {%- set ns.last_non_tool_call_assistant_msg = idx -%}
        {%- break -%}
    {%- endif -%}
{%- endfor -%}

{# split all messages into history & suffix, reasoning_content in suffix should be reserved.#}
{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}
{%- set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg+1:] -%}

{%- if tools -%}
  {%- if tools_ts_str -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools_ts_str }}<|im_end|>
  {%- else -%}
    <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
  {%- endif -%}
{%- endif -%}

{%- for message in hist_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    <think></think>{{render_content(message)}}
    {%- if message.get('tool_calls') -%}
      {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}

{%- for message in suffix_msgs -%}
  {{set_roles(message)}}
  {%- if message['role'] == 'assistant' -%}
    {%- if thinking is defined and thinking is false -%}
    <think></think>{{render_content(message)}}
    {%- else -%}
    {%- set rc = message.get('reasoning_content', '') -%}
    <think>{{rc}}</think>{{render_content(message)}}
    {%- endif -%}
    {%- if message.get('tool_calls') -%}
     {{render_toolcalls(message)}}
    {%- endif -%}
  {%- elif message['role'] == 'tool' -%}
    {%- set tool_call_id = message.tool_call_id -%}
    ## Return of {{ tool_call_id }}
{{render_content(message)}}
  {%- elif message['content'] is not none -%}
    {{render_content(message)}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}


{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}
  <think></think>
  {%- else -%}
  <think>
  {%- endif -%}
{%- endif -%}"""

# Texts of many kinds: the BPE is trained on recombinations of them, and ids are compared on
# them and on other recombinations.
SNIPPETS = [
    "The quick brown fox jumps over the lazy dog. It's what we'll do, isn't it? I'd say they're right.",
    "HTTPServer iPhone McDONALD'S XMLHttpRequest camelCaseName snake_case_name SCREAMING_CASE",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) {\n\tprintf(\"%d\\n\", i * i);\n}\r\n",
    "const x = await fetch(`/api/v1/items?id=${id}`); // TODO: retry\n",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    '{"name": "Kimi", "version": 2.5, "tags": ["moe", "mla"], "ok": true, "n": null}',
    "今天天气很好，我们去公园散步吧。人工智能正在改变世界。",
    "日本語のテキストとカタカナ、ひらがな、漢字が混ざっています。",
    "한국어 문장은 띄어쓰기를 합니다. 서울특별시",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Ελληνικά κείμενα.",
    "مرحبا بالعالم، هذا نص عربي للاختبار.",
    "हिन्दी में लिखा हुआ वाक्य, देवनागरी लिपि।",
    "naïve café résumé — Ünïcödé ß ﬁ ǅ Ω≈ç√ ∑ ∫ ∞",
    "e\u0301 a\u0308 n\u0303 combining marks, and \u200bzero\u200dwidth, \u00a0nbsp\u3000ideographic",
    "🤖👨\u200d👩\u200d👧\u200d👦🏳️\u200d🌈 emoji 👍🏽 ✨",
    "12345678901234567890 3.14159 -0.5e-10 0x1F 1,000,000 2026-01-27 10:30:00",
    "    indented\n\n\n\t\ttabs   \r\n   trailing   \n",
    "a" * 80 + " " * 40 + "=" * 30 + "-" * 25 + "\n" * 6,
    "Mixed 中文English混合text123数字, and 'quotes' \"double\" (parens) [brackets] {braces}",
]
CORNER_TEXTS = [
    "",
    " ",
    "\n",
    "<|im_end|>",
    "x<|im_end|>y <|im_user|>user<|im_middle|>hi<|im_end|>",
    "<think>reasoning</think>answer",
    "[BOS][EOS][UNK][PAD]",
    "<|reserved_token_163589|> and <|reserved_token_163700|>",
    "<|im_ <|IM_END|> <|im_end| |im_end|> <think <|tool_call_begin",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
    "<|tool_call_end|><|tool_calls_section_end|>",
    " " * 300 + "x",
    "\t\n \r\n\u2028\u2029\u0085",
    "ＦＵＬＬＷＩＤＴＨ ｆｏｒｍｓ ①②③ Ⅻ ½",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𓀀 🜁",
]


def _corpus(seed: int, count: int) -> Iterator[str]:
    rnd = random.Random(seed)
    for _ in range(count):
        parts = []
        for _ in range(rnd.randint(1, 5)):
            text = rnd.choice(SNIPPETS)
            start = rnd.randrange(len(text))
            parts.append(text[start : start + rnd.randint(1, 120)])
        yield rnd.choice(["", " ", "\n", "  "]).join(parts)


def _byte_level() -> dict[str, int]:
    """The byte-level alphabet back to bytes (the test's own table, GPT-2's)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {chr(b): b for b in printable}
    extra = [b for b in range(256) if b not in printable]
    chars.update({chr(256 + n): b for n, b in enumerate(extra)})
    return chars


def _kimi_shaped_ranks() -> dict[bytes, int]:
    """A trained BPE (all 256 bytes, then merges in training order), then tokens of the bytes
    F5..FF (never in UTF-8 text; each the join of two shorter ones) up to Kimi's size."""
    trainer_model = Backend(bpe_models.BPE())
    trainer_model.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=6000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    trainer_model.train_from_iterator([*SNIPPETS, *_corpus(1, 4000)], trainer)
    back = _byte_level()
    ranks = {bytes(back[c] for c in token): rank for token, rank in trainer_model.get_vocab().items()}
    assert sorted(ranks.values()) == list(range(len(ranks)))
    unused = bytes(range(0xF5, 0x100))
    length = 2
    while len(ranks) < BASE:
        for combo in product(unused, repeat=length):
            if len(ranks) == BASE:
                break
            ranks[bytes(combo)] = len(ranks)
        length += 1
    return ranks


def _write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n"
                            for token, rank in sorted(ranks.items(), key=lambda item: item[1])))


def _write_kimi_dir(directory: Path, ranks: dict[bytes, int], template: str = KIMI_K25_TEMPLATE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    _write_ranks(directory / "tiktoken.model", ranks)
    (directory / "tokenizer_config.json").write_text(json.dumps(KIMI_CONFIG, indent=2))
    (directory / "chat_template.jinja").write_text(template)
    (directory / "config.json").write_text(json.dumps({"model_type": "kimi_k25"}))
    return directory


def _reference(ranks: dict[bytes, int], declared: dict[int, tuple[str, bool]]) -> tiktoken.Encoding:
    """tiktoken as tokenization_kimi.py builds it: 256 special tokens after the ranks."""
    specials = {declared[i][0] if i in declared else f"<|reserved_token_{i}|>": i
                for i in range(len(ranks), len(ranks) + 256)}
    return tiktoken.Encoding("kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """tandem's and tiktoken's caches in the test's own directories."""
    root = tmp_path_factory.mktemp("caches")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_CACHE_DIR", str(root / "tandem"))
        patch.setenv("TIKTOKEN_CACHE_DIR", str(root / "tiktoken"))
        yield root


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return _kimi_shaped_ranks()


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory, ranks: dict[bytes, int], cache_env: Path) -> Path:
    return _write_kimi_dir(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5", ranks)


@pytest.fixture(scope="module")
def tok(kimi_dir: Path) -> Tokenizer:
    return load_tokenizer(kimi_dir)


@pytest.fixture(scope="module")
def ref(ranks: dict[bytes, int]) -> tiktoken.Encoding:
    return _reference(ranks, KIMI_ADDED)


def _texts() -> list[str]:
    specials = [text for text, _ in KIMI_ADDED.values()]
    rnd = random.Random(7)
    mixed = []
    for text in _corpus(2, 300):  # other recombinations than the training corpus, specials inside
        at = rnd.randrange(len(text) + 1)
        mixed.append(text[:at] + rnd.choice(specials) + text[at:])
    return [*SNIPPETS, *CORNER_TEXTS, *mixed]


# --- encoding -----------------------------------------------------------------------------------
def test_ids_are_tiktokens(tok: Tokenizer, ref: tiktoken.Encoding) -> None:
    texts = _texts()
    for text in texts:
        expected = ref.encode(text, allowed_special="all")
        assert tok.encode(text) == expected, text
        assert tok.encode(text, add_special_tokens=False) == expected, text
    assert tok(texts)["input_ids"] == [ref.encode(text, allowed_special="all") for text in texts]
    # The whole text at once too: a long prompt with every kind of text in it.
    whole = "\n".join(texts)
    assert tok.encode(whole) == ref.encode(whole, allowed_special="all")


def test_vocabulary_sizes_and_named_tokens(tok: Tokenizer) -> None:
    assert (tok.vocab_size, len(tok)) == (BASE, VOCAB)
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("[BOS]", "[EOS]", "[UNK]", "[PAD]")
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (163584, 163585, 163838, 163839)
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)  # no BOS added, as Kimi's


def test_special_tokens_are_single_ids_at_kimis_ids(tok: Tokenizer) -> None:
    for index, (text, _) in KIMI_ADDED.items():
        assert tok.convert_tokens_to_ids(text) == index
        assert tok.encode(text) == [index]
        assert tok.encode(f"a{text}b") == [*tok.encode("a"), index, *tok.encode("b")]
    for index in (163589, 163592, 163600, 163608, 163700, 163837):
        reserved = f"<|reserved_token_{index}|>"
        assert tok.encode(reserved) == [index] and tok.convert_ids_to_tokens(index) == reserved


def test_decoding_matches_tiktoken_and_round_trips(tok: Tokenizer, ref: tiktoken.Encoding) -> None:
    for text in _texts():
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    rnd = random.Random(3)
    for _ in range(300):  # any ids: partial characters, the padding tokens' non-UTF-8 bytes, specials
        ids = [rnd.randrange(VOCAB) if rnd.random() < 0.3 else rnd.randrange(6000) for _ in range(rnd.randint(1, 12))]
        assert tok.decode(ids) == ref.decode(ids)


def test_skip_special_tokens_follows_the_configs_flags(tok: Tokenizer) -> None:
    text = ("[BOS]<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
            "<think>hmm</think>Hello<|media_begin|><|media_pad|><|media_end|>"
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
            "<|tool_call_end|><|tool_calls_section_end|><|reserved_token_163700|>[EOS]")
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # Special in K2.5's config: dropped; <think> and the tool-call markers are not special there
    # (and tandem's reserved tokens are special): as transformers decodes with Kimi's config.
    assert tok.decode(ids, skip_special_tokens=True) == (
        "userHiassistant<think>hmm</think>Hello<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")


@pytest.mark.parametrize("skip", [True, False])
def test_streaming_detokenization_equals_the_whole_decode(tok: Tokenizer, skip: bool) -> None:
    prompt = tok.encode("<|im_user|>user<|im_middle|>Say something<|im_end|>")
    for text in [*SNIPPETS, *CORNER_TEXTS, "<think>思考中……</think>答案：42 🤖<|im_end|>"]:
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        streamed = "".join(detok.add(i) for i in ids) + detok.flush()
        assert streamed == tok.decode(ids, skip_special_tokens=skip), text


# --- the chat template --------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city, in °C.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_DECLARATION = ('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
                    '"description":"Weather for a city, in °C.","parameters":{"type":"object","properties":'
                    '{"city":{"type":"string"}},"required":["city"]}}}]<|im_end|>')
CALL_ID = "functions.get_weather:0"
CHAT = [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "The user wants the weather.",
     "tool_calls": [{"id": CALL_ID, "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": 9}'},
]
HEAD = (TOOL_DECLARATION + "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Zürich?<|im_end|><|im_assistant|>assistant<|im_middle|>")
CALL = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Zürich"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"temp": 9}<|im_end|>'
        '<|im_assistant|>assistant<|im_middle|>')
THINKING_ON = HEAD + "<think>The user wants the weather.</think>" + CALL + "<think>"
THINKING_OFF = HEAD + "<think></think>" + CALL + "<think></think>"
# The server computes `tools_ts_str` (server/typescript_tools.py), as Moonshot's tokenizer code
# does: the tools declared as TypeScript function types.
TS_TOOLS = ("# Tools\n\n## functions\nnamespace functions {\n// Weather for a city, in °C.\n"
            "type get_weather = (_: {\n  city: string\n}) => any;\n}\n")


def served(prompt: str) -> str:
    """`prompt` as the server renders it: the tools in TypeScript."""
    return prompt.replace(TOOL_DECLARATION, f"<|im_system|>tool_declare<|im_middle|>{TS_TOOLS}<|im_end|>")


def test_chat_template_with_tools_a_call_its_result_and_thinking(tok: Tokenizer) -> None:
    assert tok.chat_template == KIMI_K25_TEMPLATE
    on = tok.apply_chat_template(CHAT, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert on == THINKING_ON
    assert tok.apply_chat_template(CHAT, tools=[WEATHER], tokenize=False, add_generation_prompt=True,
                                   thinking=True) == THINKING_ON
    off = tok.apply_chat_template(CHAT, tools=[WEATHER], tokenize=False, add_generation_prompt=True, thinking=False)
    assert off == THINKING_OFF
    # Once an answer without calls closes the turn, earlier reasoning leaves the prompt.
    done = [*CHAT, {"role": "assistant", "content": "9 °C.", "reasoning_content": "Report it."},
            {"role": "user", "content": "Thanks"}]
    assert tok.apply_chat_template(done, tools=[WEATHER], tokenize=False, add_generation_prompt=True) == (
        HEAD + "<think></think>" + CALL + "<think></think>9 °C.<|im_end|>"
        "<|im_user|>user<|im_middle|>Thanks<|im_end|><|im_assistant|>assistant<|im_middle|><think>")


def test_a_rendered_prompt_holds_each_marker_as_one_id(tok: Tokenizer, ref: tiktoken.Encoding) -> None:
    ids = tok.apply_chat_template(CHAT, tools=[WEATHER], add_generation_prompt=True, return_dict=False)
    assert ids == ref.encode(THINKING_ON, allowed_special="all")
    assert tok.decode(ids) == THINKING_ON
    for index, (text, _) in KIMI_ADDED.items():
        assert ids.count(index) == THINKING_ON.count(text), text
    assert ids.count(IM_END) == 5 and ids[-1] == 163606  # ends in the open <think>


def test_server_rendering_with_chat_template_kwargs_and_kimi_call_ids(tok: Tokenizer) -> None:
    """As the server renders a request (OpenAI messages, `chat_template_kwargs`): the call id
    the kimi_k2 parser gave the client comes back in the history, and the template writes the
    call as the model wrote it, so the parser reads the same call out of the prompt."""
    assert detect_tool_parser(tok.chat_template) == "kimi_k2"
    parser = KimiK2ToolParser()
    output = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
              '<|tool_call_argument_begin|>{"city": "Zürich"}<|tool_call_end|><|tool_calls_section_end|>')
    [call] = parser.parse(output).tool_calls
    assert (call.id, call.name) == (CALL_ID, "get_weather")
    messages = [ChatMessage(role="system", content="You are Kimi."),
                ChatMessage(role="user", content="Weather in Zürich?"),
                ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call.to_openai()]}),
                ChatMessage(role="tool", tool_call_id=call.id, content='{"temp": 9}')]
    tools = [Tool.model_validate(WEATHER)]
    off = render_chat_prompt(tok, messages, tools, "auto", parser, template_kwargs={"thinking": False})
    assert off.text == served(THINKING_OFF) and off.tools_enabled
    assert off.text == tok.apply_chat_template([m.model_dump(exclude_none=True) for m in messages], tools=[WEATHER],
                                               tokenize=False, add_generation_prompt=True, thinking=False,
                                               tools_ts_str=TS_TOOLS)
    on = render_chat_prompt(tok, messages, tools, "auto", parser, template_kwargs=None)
    assert on.text == served(HEAD + "<think></think>" + CALL + "<think>")  # the client sent no reasoning back
    section = off.text[off.text.index("<|tool_calls_section_begin|>"): off.text.index("<|im_end|>", len(HEAD))]
    [again] = parser.parse(section).tool_calls
    assert (again.id, again.name, json.loads(again.arguments)) == (call.id, call.name, json.loads(call.arguments))



def test_the_reasoning_and_the_calls_sent_back_render_as_the_model_wrote_them(tok: Tokenizer) -> None:
    """A thinking turn in progress: the client sends the call round back with its reasoning
    (`reasoning_content`, or `reasoning`) and the arguments string as generated. The prompt
    must be the one the model wrote into (THINKING_ON), so the next round continues the
    cached prefix: the reasoning kept, and the arguments not re-serialized (compact JSON
    stays compact, where parsing and `tojson` would add a space)."""
    parser = KimiK2ToolParser()
    tools = [Tool.model_validate(WEATHER)]
    for field in ("reasoning_content", "reasoning"):
        messages = [ChatMessage(role="system", content="You are Kimi."),
                    ChatMessage(role="user", content="Weather in Zürich?"),
                    ChatMessage.model_validate({"role": "assistant", "content": None,
                                                field: "The user wants the weather.",
                                                "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
                                                    "name": "get_weather", "arguments": '{"city": "Zürich"}'}}]}),
                    ChatMessage(role="tool", tool_call_id=CALL_ID, content='{"temp": 9}')]
        assert render_chat_prompt(tok, messages, tools, "auto", parser).text == served(THINKING_ON), field
    compact = [ChatMessage(role="user", content="Weather in Zürich?"),
               ChatMessage.model_validate({"role": "assistant", "tool_calls": [{"id": CALL_ID, "function": {
                   "name": "get_weather", "arguments": '{"city":"Zürich"}'}}]})]
    text = render_chat_prompt(tok, compact, tools, "auto", parser, add_generation_prompt=False).text
    assert '<|tool_call_argument_begin|>{"city":"Zürich"}<|tool_call_end|>' in text


# --- grammar-constrained decoding ---------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]}, "days": {"type": "integer"}},
          "required": ["city", "days"], "additionalProperties": False}


def _compiled(constraints: GrammarConstraints, request: Request) -> None:
    deadline = time.monotonic() + 300
    while not constraints.ready(request):
        assert constraints.wait_for_compile(0.05) or constraints.ready(request), constraints.failures()
        assert time.monotonic() < deadline, "the grammar never compiled"


def test_an_llguidance_grammar_on_this_vocabulary_constrains(kimi_dir: Path, tok: Tokenizer) -> None:
    constraints = GrammarConstraints(TokenizerSource(kimi_dir, VOCAB, [IM_END]))
    try:
        request = Request("json", [1, 2, 3], SamplingParams(guided=GuidedDecoding(json=json.dumps(SCHEMA)),
                                                            max_tokens=64), frozenset({IM_END}))
        constraints.add(request)
        _compiled(constraints, request)
        first = constraints.masks([("json", [])]).resolve()["json"][0]
        assert not mask_allows(first, tok.encode("x")[0])
        assert not mask_allows(first, IM_END)
        assert not mask_allows(first, tok.encode("<think>")[0])
        answer = tok.encode('{"city": "Zürich", "days": 3}')
        for token in answer:
            assert mask_allows(constraints.masks([("json", [])]).resolve()["json"][0], token), tok.decode([token])
            request.append_output_token(token)
            verdict = constraints.accept(request)
            assert verdict is None or verdict == "stop"
        assert mask_allows(constraints.masks([("json", [])]).resolve()["json"][0], IM_END)
        refused = Request("bad", [1], SamplingParams(guided=GuidedDecoding(json=json.dumps(SCHEMA)), max_tokens=8),
                          frozenset({IM_END}))
        constraints.add(refused)
        _compiled(constraints, refused)
        for token in tok.encode('{"city": "Rome'):
            refused.append_output_token(token)
        assert constraints.accept(refused) not in (None, "stop")  # Rome is not in the enum
    finally:
        constraints.shutdown()


# --- loading: cache, files, no remote code ------------------------------------------------------
def test_the_converted_vocabulary_is_cached_and_keyed_by_content(
        tmp_path: Path, kimi_dir: Path, tok: Tokenizer, cache_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = list((cache_env / "tandem" / "tokenizers").glob("tiktoken-*.json"))
    assert len(cached) == 1
    monkeypatch.setattr(tiktoken_tokenizer, "convert_ranks", _no_conversion)
    again = load_tokenizer(kimi_dir)  # from the cache: converting would raise
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    monkeypatch.undo()

    # One vocabulary at a path, then another: each load reads the file that is there now
    # (neither tandem's cache nor tiktoken's own copy of the path may answer for the old one).
    small = {bytes([b]): b for b in range(256)}
    small.update({b"ab": 256, b"abc": 257})
    directory = _write_kimi_dir(tmp_path / "model", small)
    with pytest.raises(FileNotFoundError, match="is not one of the special ids 258..513"):
        load_tokenizer(directory)  # K2.5's special ids (163584...) do not follow this vocabulary
    (directory / "tokenizer_config.json").write_text("{}")
    first = load_tokenizer(directory)
    assert (len(first), first.encode("abcab"), first.encode("ca")) == (514, [257, 256], [99, 97])
    assert first.encode("<|reserved_token_258|>") == [258]
    small[b"ca"] = 258
    _write_ranks(directory / "tiktoken.model", small)
    second = load_tokenizer(directory)
    assert (len(second), second.encode("ca")) == (515, [258])
    assert second.encode("<|reserved_token_259|>") == [259]
    assert len(list((cache_env / "tandem" / "tokenizers").glob("tiktoken-*.json"))) == 3


def test_a_token_merges_cannot_reach_is_taken_whole(tmp_path: Path, cache_env: Path) -> None:
    """tiktoken takes a piece that is a token as that token, before any merging; here merging
    "abcd" byte by byte stops at a|bc|d (neither "abc" nor "bcd" is a token)."""
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"bc": 256, b"ab": 257, b"cd": 258, b"abcd": 259})
    directory = _write_kimi_dir(tmp_path / "model", ranks)
    (directory / "tokenizer_config.json").write_text("{}")
    tokenizer = load_tokenizer(directory)
    reference = _reference(ranks, {})
    for text in ("abcd", "xabcd abcd", "abc", "bcd abcde"):
        assert tokenizer.encode(text) == reference.encode(text, allowed_special="all"), text
    assert tokenizer.encode("abcd") == [259]  # a whole piece
    assert tokenizer.encode(" abcd") == [32, 97, 256, 100]  # " abcd" is not a token: merging it stops


def _no_conversion(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("converted again instead of reading the cache")


def test_nothing_of_the_directory_runs_and_no_torch(tmp_path: Path, kimi_dir: Path, cache_env: Path) -> None:
    """The directory's tokenization_kimi.py is never imported, and loading needs neither
    transformers nor torch (the API process never imports them)."""
    marker = tmp_path / "ran"
    (kimi_dir / "tokenization_kimi.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    try:
        code = ("import sys\nfrom tandem.loader.tokenizer import load_tokenizer\n"
                f"t = load_tokenizer({str(kimi_dir)!r})\nassert t.encode('<|im_end|>') == [{IM_END}]\n"
                "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported'\n")
        env = {**os.environ, "TANDEM_CACHE_DIR": str(cache_env / "tandem"),
               "TIKTOKEN_CACHE_DIR": str(cache_env / "tiktoken")}
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                                cwd=str(tmp_path))
        assert result.returncode == 0, result.stderr[-3000:]
        assert not marker.exists()
    finally:
        (kimi_dir / "tokenization_kimi.py").unlink()


def test_ranks_that_are_not_the_ids_are_refused(tmp_path: Path, cache_env: Path) -> None:
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 300  # a gap: the special tokens would not be at len(ranks)
    directory = tmp_path / "gap"
    directory.mkdir()
    _write_ranks(directory / "tiktoken.model", ranks)
    with pytest.raises(FileNotFoundError, match="ranks are not the ids"):
        load_tokenizer(directory)


def test_reference_reads_the_same_file(kimi_dir: Path, ranks: dict[bytes, int]) -> None:
    """The fixture's file holds what the reference encodes with (tiktoken's own reader)."""
    assert load_tiktoken_bpe(str(kimi_dir / "tiktoken.model")) == ranks


def test_tools_the_typescript_form_cannot_write_are_declared_as_json(tok: Tokenizer) -> None:
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}
    prompt = render_chat_prompt(tok, [ChatMessage(role="user", content="Hi")], [Tool.model_validate(odd)], "auto",
                                KimiK2ToolParser()).text
    assert prompt.startswith('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"f"')
    assert "namespace functions" not in prompt


def test_the_router_counts_prompts_with_the_same_ids(kimi_dir: Path, ref: tiktoken.Encoding) -> None:
    """`tandem route --tokenizer DIR` / `tandem up` on a Kimi directory: the router's prompt
    counts (PD threshold, scoring) are tiktoken's own, not 4 characters a token."""
    from tandem.router.placement.prompt_tokens import PromptCounter

    counter = PromptCounter(kimi_dir)
    assert counter.exact
    for text in ("Weather in Zürich? 天气怎么样", "def add(a, b):\n    return a - b\n" * 20):
        assert counter.count_text(text) == len(ref.encode(text)) != max(1, len(text) // 4)
