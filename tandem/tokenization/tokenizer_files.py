"""What a model directory says about its tokenizer, read the way transformers reads it.

`tokenizer.json` holds the model (vocabulary, merges, normalizer, pre-tokenizer, decoder,
post-processor) and is loaded by the `tokenizers` package as it is. Everything else lives in
`tokenizer_config.json` (plus a few legacy files): the named special tokens, added tokens whose
flags override the ones in tokenizer.json, decoding clean-up, and the chat template(s), which
may also come from `chat_template.jinja` and `additional_chat_templates/*.jinja`.

transformers (5.x, `TokenizersBackend` / `PreTrainedTokenizerFast`) is the reference: the
precedence rules and the token bookkeeping below follow what it does on the same files, so the
same directory gives the same special tokens, the same ids and the same prompts. Notably, with
a tokenizer.json present, `add_bos_token` / `add_eos_token` in the config do not change
encoding: the post-processor in tokenizer.json decides, as it does in transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# A processor's template file (multimodal models); transformers' tokenizer never reads it, so it
# is only a fallback here, for directories whose template lives nowhere else.
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
ADDED_TOKENS_FILE = "added_tokens.json"

# The named special tokens every tokenizer has (possibly unset), in transformers' order.
STANDARD_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

ChatTemplate = str | dict[str, str]
TokenValue = str | AddedToken


@dataclass
class TokenizerSettings:
    """Everything besides tokenizer.json that decides how the tokenizer behaves.

    `special_tokens` maps each named special token (the standard ones, then model-specific
    ones such as `image_token`) to its text; `extra_special_tokens` are the unnamed ones.
    `tokens_to_add` are the added tokens to (re-)register on the backend, in order, with the
    flags the config gives them.
    """

    special_tokens: dict[str, str] = field(default_factory=dict)
    extra_special_tokens: list[str] = field(default_factory=list)
    tokens_to_add: list[AddedToken] = field(default_factory=list)
    chat_template: ChatTemplate | None = None
    clean_up_tokenization_spaces: bool = False
    clean_up_bpe_anyway: bool = False
    split_special_tokens: bool = False
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    model_max_length: int | None = None


def has_tokenizer_json(hf_dir: Path) -> bool:
    return (hf_dir / TOKENIZER_FILE).is_file()


def read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)


def read_settings(hf_dir: Path, backend_added: dict[int, AddedToken]) -> TokenizerSettings:
    """The settings for a tokenizer.json-based tokenizer in `hf_dir`.

    `backend_added` are the added tokens tokenizer.json already has (by id): a special token
    missing from them is added as a new special token, as transformers does.
    """
    config_path = hf_dir / CONFIG_FILE
    config: dict[str, Any] = read_json(config_path) if config_path.is_file() else {}
    config.pop("tokenizer_class", None)
    # transformers drops these whenever tokenizer.json is there; its post-processor rules.
    add_bos = config.pop("add_bos_token", None)
    add_eos = config.pop("add_eos_token", None)
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")

    # Non-standard `*_token` strings are model-specific named tokens (e.g. `image_token`).
    declared = {
        key: config.pop(key)
        for key in list(config)
        if key not in STANDARD_SPECIAL_TOKENS and key.endswith("_token") and isinstance(config[key], str)
    }
    if isinstance(config.get("extra_special_tokens"), dict):
        declared.update(config.pop("extra_special_tokens"))

    added_by_id: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in config:
        for index, token in config.pop("added_tokens_decoder").items():
            added_by_id[int(index)] = _added_token(token)
    else:
        _merge_legacy_special_tokens_map(hf_dir, config, declared)
        added_by_id.update(_legacy_added_tokens(hf_dir, config))
        added_by_id.update(backend_added)  # tokenizer.json's own, re-registered as they are
    config = _convert_added_tokens(config)
    declared = _convert_added_tokens(declared)
    # `{"__type": "AddedToken", ...}` values only become tokens now, and are then named too.
    found = {
        key: value
        for key, value in config.items()
        if key not in STANDARD_SPECIAL_TOKENS and key.endswith("_token") and isinstance(value, (str, AddedToken))
    }
    model_specific = {**found, **declared}

    named: dict[str, TokenValue] = {}
    for key in (*STANDARD_SPECIAL_TOKENS, *model_specific):
        value = model_specific.get(key, config.get(key))
        if value is None:
            continue
        if not isinstance(value, (str, AddedToken)):
            raise ValueError(f"{CONFIG_FILE}: special token {key} must be a string, got {value!r}")
        named[key] = value
    extra = config.get("extra_special_tokens") or []
    if not isinstance(extra, (list, tuple)):
        raise ValueError(f"{CONFIG_FILE}: extra_special_tokens must be a list or a dict, got {extra!r}")

    return TokenizerSettings(
        special_tokens={key: str(value) for key, value in named.items()},
        extra_special_tokens=list(dict.fromkeys(str(token) for token in extra)),
        tokens_to_add=_tokens_to_add(added_by_id, named, list(extra), [t.content for t in backend_added.values()]),
        chat_template=read_chat_template(hf_dir, config.get("chat_template")),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        clean_up_bpe_anyway=bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        ),
        split_special_tokens=bool(config.get("split_special_tokens", False)),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        model_max_length=config.get("model_max_length"),
    )


def _added_token(token: Any) -> AddedToken:
    if isinstance(token, AddedToken):
        return token
    if isinstance(token, dict):
        fields = {key: value for key, value in token.items() if key != "__type"}
        return AddedToken(**fields)
    raise ValueError(f"{CONFIG_FILE}: added token must be an object, got {token!r}")


def _convert_added_tokens(value: Any) -> Any:
    """`{"__type": "AddedToken", ...}` objects, at any depth, into AddedTokens."""
    if isinstance(value, dict):
        if value.get("__type") == "AddedToken":
            return _added_token(value)
        return {key: _convert_added_tokens(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_convert_added_tokens(item) for item in value]
    return value


def _merge_legacy_special_tokens_map(hf_dir: Path, config: dict[str, Any], declared: dict[str, Any]) -> None:
    """special_tokens_map.json (older checkpoints) overrides the config's special tokens."""
    path = hf_dir / SPECIAL_TOKENS_MAP_FILE
    if not path.is_file():
        return
    for key, value in read_json(path).items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            fields = {k: v for k, v in value.items() if k not in ("special", "__type")}
            value = AddedToken(**fields, special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            merged = list(config.get("extra_special_tokens") or [])
            for token in value:
                token = AddedToken(**token, special=True) if isinstance(token, dict) else token
                if token not in merged:
                    merged.append(token)
            value = merged
        config[key] = value
    if "additional_special_tokens" in config and "extra_special_tokens" not in config:
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    if isinstance(config.get("extra_special_tokens"), dict):
        declared.update(config.pop("extra_special_tokens"))


def _legacy_added_tokens(hf_dir: Path, config: dict[str, Any]) -> dict[int, AddedToken]:
    """added_tokens.json (older checkpoints): plain added tokens, special if named as such."""
    path = hf_dir / ADDED_TOKENS_FILE
    if not path.is_file():
        return {}
    special = {str(config[key]) for key in STANDARD_SPECIAL_TOKENS if config.get(key)}
    special.update(str(token) for token in config.get("extra_special_tokens") or [])
    out = {}
    for text, index in read_json(path).items():
        is_special = text in special
        out[int(index)] = AddedToken(text, rstrip=False, lstrip=False, normalized=not is_special, special=is_special)
    return out


def _tokens_to_add(
    added_by_id: dict[int, AddedToken],
    named: dict[str, TokenValue],
    extra: list[TokenValue],
    backend_added_tokens: list[str],
) -> list[AddedToken]:
    """The config's added tokens, then any special token the vocabulary lacks.

    A named special token is always registered as special, whatever flag the config gives it.
    """
    pending: list[TokenValue] = [token for _, token in sorted(added_by_id.items())]
    known = set(backend_added_tokens) | {str(token) for token in pending}
    for value in (*named.values(), *extra):
        if str(value) not in known:
            pending.append(value)
            known.add(str(value))
    named_texts = {str(value) for value in named.values()}
    tokens = []
    for token in pending:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_texts:
            token.special = True
        tokens.append(token)
    return tokens


def read_chat_template(hf_dir: Path, from_config: Any) -> ChatTemplate | None:
    """The chat template(s): separate .jinja files win over the config's entry.

    A config may hold one template, or a list of `{"name", "template"}` (returned as a dict of
    named templates, "default" and "tool_use" being the ones picked automatically).
    """
    templates: dict[str, str] = {}
    default_file = hf_dir / CHAT_TEMPLATE_FILE
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = hf_dir / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    if isinstance(from_config, (list, tuple)):
        return {entry["name"]: entry["template"] for entry in from_config}
    if from_config is not None:
        return from_config
    legacy = hf_dir / LEGACY_CHAT_TEMPLATE_FILE
    if legacy.is_file():
        value = read_json(legacy).get("chat_template")
        if isinstance(value, (list, tuple)):
            return {entry["name"]: entry["template"] for entry in value}
        return value
    return None
