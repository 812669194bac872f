"""Tokenizer and chat template, from the model directory only (never a hub), without torch.

The API process of `tandem serve` and the router tokenize, detokenize and render chat templates
but never run the model, so they must not pay for (or depend on) torch, which transformers
imports. `Tokenizer` is a small tokenizer built on the `tokenizers` package (tokenizer.json)
and jinja2 (the chat template), with the part of transformers' `PreTrainedTokenizerFast` API
that tandem uses and the same results: same ids, same text, same prompts.

A directory with Kimi's `tiktoken.model` instead of tokenizer.json is converted into the same
kind of backend without transformers (tokenization/tiktoken_tokenizer.py). A directory with neither (only a
SentencePiece `tokenizer.model`, or vocab + merges files) has nothing the `tokenizers` package
can read directly; there, and only there, transformers converts the files once at load time
(importing it, and torch, in that process).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

from tandem.loader.chat_template import ChatTemplates
from tandem.tokenization.tiktoken_tokenizer import has_tiktoken_model, tiktoken_backend
from tandem.tokenization.tokenizer_files import (
    CONFIG_FILE,
    STANDARD_SPECIAL_TOKENS,
    TOKENIZER_FILE,
    ChatTemplate,
    TokenizerSettings,
    has_tokenizer_json,
    read_chat_template,
    read_json,
    read_settings,
)

logger = logging.getLogger(__name__)

# transformers' apply_chat_template options tandem does not implement; refused rather than
# passed to the template as variables.
_UNSUPPORTED_CHAT_OPTIONS = (
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_assistant_tokens_mask",
    "sanitize_control_tokens",
)


class Tokenizer:
    """Encode, decode and render chats like transformers' fast tokenizer, from tokenizer.json.

    Immutable once built: encoding never reconfigures the backend, so one instance may be
    shared by threads.
    """

    def __init__(self, backend: Backend, settings: TokenizerSettings, name_or_path: str = "") -> None:
        self._backend = backend
        self._settings = settings
        self.name_or_path = name_or_path
        self._templates = ChatTemplates(settings.chat_template)
        self._special = dict(settings.special_tokens)
        # Unknown tokens map to unk's id, as in transformers (None without an unk token).
        unk = self._special.get("unk_token")
        self._unk_id = backend.token_to_id(unk) if unk is not None else None
        self._all_special_tokens = list(dict.fromkeys([*self._special.values(), *settings.extra_special_tokens]))
        self._all_special_ids = [self._token_id(token) for token in self._all_special_tokens]
        # transformers' clean-up (spaces before punctuation) is skipped for BPE models unless forced.
        self._clean_up = settings.clean_up_tokenization_spaces and (
            type(backend.model).__name__ != "BPE" or settings.clean_up_bpe_anyway
        )

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_directory(cls, hf_dir: Path) -> Tokenizer:
        """From tokenizer.json and tokenizer_config.json, configured as transformers configures it."""
        return cls.from_backend(Backend.from_file(str(hf_dir / TOKENIZER_FILE)), hf_dir)

    @classmethod
    def from_backend(cls, backend: Backend, hf_dir: Path) -> Tokenizer:
        """`backend` (tokenizer.json's, or one converted from the directory's other files)
        configured by the directory's tokenizer_config.json, as transformers configures it."""
        settings = read_settings(hf_dir, backend.get_added_tokens_decoder())
        # Encoding never truncates or pads (transformers resets both on every call).
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = settings.split_special_tokens
        if settings.tokens_to_add:
            backend.add_tokens(settings.tokens_to_add)
        if backend.post_processor is None:
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        return cls(backend, settings, str(hf_dir))

    # --- encoding -----------------------------------------------------------------------------
    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True) -> list[int]:
        """Token ids; `add_special_tokens` applies the post-processor (e.g. a BOS token)."""
        return self._backend.encode(text, text_pair, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, list[Any]]:
        """`{"input_ids", "attention_mask"}` for one text, or lists of them for a batch."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        encodings = self._backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings], "attention_mask": [e.attention_mask for e in encodings]}

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).tokens

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return self._backend.num_special_tokens_to_add(pair)

    # --- decoding -----------------------------------------------------------------------------
    def decode(
        self,
        token_ids: int | Sequence[int] | Sequence[Sequence[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str | list[str]:
        """Text for ids (a list of texts for a batch of id lists)."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if len(token_ids) > 0 and isinstance(token_ids[0], (list, tuple)):
            return self.batch_decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces)
        text = self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        clean_up = self._clean_up if clean_up_tokenization_spaces is None else (
            clean_up_tokenization_spaces
            and (type(self._backend.model).__name__ != "BPE" or self._settings.clean_up_bpe_anyway)
        )
        return _clean_up_tokenization(text) if clean_up else text

    def batch_decode(
        self,
        sequences: Iterable[Sequence[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> list[str]:
        return [self.decode(list(ids), skip_special_tokens, clean_up_tokenization_spaces) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self._all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        decoder = self._backend.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    def _token_id(self, token: str) -> int | None:
        index = self._backend.token_to_id(token)
        return self._unk_id if index is None else index

    # --- vocabulary ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (`len()` counts those too)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._backend.get_added_tokens_decoder()

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {token.content: index for index, token in sorted(self.added_tokens_decoder.items())}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    @property
    def backend_tokenizer(self) -> Backend:
        return self._backend

    # --- special tokens -----------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set: also the template variables of those names."""
        return dict(self._special)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(self._all_special_tokens)

    @property
    def all_special_ids(self) -> list[int | None]:
        return list(self._all_special_ids)

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self._settings.extra_special_tokens)

    @property
    def bos_token(self) -> str | None:
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special.get("eos_token")

    @property
    def unk_token(self) -> str | None:
        return self._special.get("unk_token")

    @property
    def pad_token(self) -> str | None:
        return self._special.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._named_id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    def _named_id(self, name: str) -> int | None:
        token = self._special.get(name)
        return None if token is None else self._token_id(token)

    def __getattr__(self, name: str) -> Any:
        """The other named special tokens (`sep_token`, `image_token`, ...) and their `_id`s."""
        special = self.__dict__.get("_special")
        if special is not None:
            base = name.removesuffix("_id")
            if base in special or base in STANDARD_SPECIAL_TOKENS:
                token = special.get(base)
                if name == base or token is None:
                    return token
                return self._token_id(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # --- settings -----------------------------------------------------------------------------
    @property
    def clean_up_tokenization_spaces(self) -> bool:
        return self._settings.clean_up_tokenization_spaces

    @property
    def split_special_tokens(self) -> bool:
        return self._settings.split_special_tokens

    @property
    def add_bos_token(self) -> bool:
        """As the config says; what encoding adds is up to tokenizer.json's post-processor."""
        return bool(self._settings.add_bos_token)

    @property
    def add_eos_token(self) -> bool:
        return bool(self._settings.add_eos_token)

    @property
    def model_max_length(self) -> int | None:
        return self._settings.model_max_length

    # --- chat ---------------------------------------------------------------------------------
    @property
    def chat_template(self) -> ChatTemplate | None:
        """The template text, a dict of named templates, or None."""
        return self._templates.templates

    def get_chat_template(self, chat_template: str | None = None, tools: Sequence[Any] | None = None) -> str:
        return self._templates.select(chat_template, tools)

    def apply_chat_template(
        self,
        conversation: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        tokenizer_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """The rendered prompt (`tokenize=False`), or its ids (as transformers' defaults, a dict).

        Extra keyword arguments become template variables, overriding special tokens of the
        same name. A list of conversations gives a list of results.
        """
        refused = [name for name in _UNSUPPORTED_CHAT_OPTIONS if kwargs.pop(name, None)]
        if refused:
            raise NotImplementedError(f"apply_chat_template options not supported by tandem: {', '.join(refused)}")
        template = self.get_chat_template(chat_template, tools)
        if not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        batched = isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
        conversations = conversation if batched else [conversation]
        variables = {**self._special, **kwargs}
        rendered = [
            self._templates.render(
                template, getattr(chat, "messages", chat), tools, documents, add_generation_prompt,
                continue_final_message, variables,
            )
            for chat in conversations
        ]
        if not tokenize:
            return rendered if batched else rendered[0]
        encoded = self(rendered if batched else rendered[0], add_special_tokens=False, **dict(tokenizer_kwargs or {}))
        return encoded if return_dict else encoded["input_ids"]

    def __repr__(self) -> str:
        return f"Tokenizer(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, special={self._special})"


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and contractions (WordPiece-era)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _from_transformers(hf_dir: Path) -> Tokenizer:
    """No tokenizer.json: transformers converts the slow files; its backend is then used as is."""
    from transformers import AutoTokenizer  # only here: it imports torch

    logger.warning("%s has no %s: converting the tokenizer with transformers (imports torch)", hf_dir, TOKENIZER_FILE)
    slow = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    backend = getattr(slow, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"transformers gave no fast tokenizer for {hf_dir}")
    config_path = hf_dir / CONFIG_FILE
    config = read_json(config_path) if config_path.is_file() else {}
    settings = TokenizerSettings(
        special_tokens=dict(slow.special_tokens_map),
        extra_special_tokens=[str(token) for token in getattr(slow, "extra_special_tokens", None) or []],
        chat_template=slow.chat_template or read_chat_template(hf_dir, None),
        clean_up_tokenization_spaces=bool(slow.clean_up_tokenization_spaces),
        clean_up_bpe_anyway=bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        ),
        split_special_tokens=bool(getattr(slow, "split_special_tokens", False)),
        add_bos_token=config.get("add_bos_token"),
        add_eos_token=config.get("add_eos_token"),
        model_max_length=config.get("model_max_length"),
    )
    backend.no_truncation()
    backend.no_padding()
    return Tokenizer(backend, settings, str(hf_dir))


def load_tokenizer(hf_dir: Path) -> Tokenizer:
    """The model's tokenizer; FileNotFoundError when the directory has none usable."""
    hf_dir = Path(hf_dir)
    try:
        if has_tokenizer_json(hf_dir):
            return Tokenizer.from_directory(hf_dir)
        if has_tiktoken_model(hf_dir):  # Kimi's: converted here, without transformers or its code
            return Tokenizer.from_backend(tiktoken_backend(hf_dir), hf_dir)
        if not any((hf_dir / name).is_file() for name in (CONFIG_FILE, "tokenizer.model", "vocab.json")):
            raise FileNotFoundError(f"no {TOKENIZER_FILE} or {CONFIG_FILE} in {hf_dir}")
        return _from_transformers(hf_dir)
    except FileNotFoundError:
        raise
    except Exception as exc:  # tokenizers and transformers raise plain Exceptions on bad files
        raise FileNotFoundError(f"no usable tokenizer in {hf_dir}: {exc}") from exc


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for a conversation, by the model's own chat template."""
    if not messages:
        raise ValueError("messages must be a non-empty list")
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use generate() with a plain prompt")
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
