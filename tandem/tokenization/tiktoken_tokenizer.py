"""Kimi's tiktoken tokenizer (`tiktoken.model`) as a `tokenizers` backend, without its code.

Kimi K2 / K2.5 ship no tokenizer.json. Their vocabulary is `tiktoken.model`: one
`base64(token bytes) rank` line per BPE token, the rank being the token's id. The rest lives in
remote code, `tokenization_kimi.py`, which tandem never runs (a model directory is untrusted):
the text is split by Kimi's own pattern (Han runs apart from other letters; below), and the
256 ids after the BPE tokens are special tokens: the ones `tokenizer_config.json` names in
`added_tokens_decoder` ([BOS] 163584, [EOS] 163585, <|im_end|>, ..., <think>, <|media_pad|>,
..., [PAD] 163839), the others `<|reserved_token_ID|>`. Text encodes as
`tiktoken.Encoding(...).encode(text, allowed_special="all")` encodes it: a special token written
in the text is its one id.

The ranks are rebuilt into a byte-level BPE of the `tokenizers` package, so that everything
built on tokenizer.json (the Tokenizer, the detokenizer, llguidance's vocabulary, offsets) works
as it does for other models. tiktoken merges, at each step, the adjacent pair whose
concatenation has the lowest rank; the same merges listed in rank order (every split of a token
into two tokens, ordered by the token's rank) make the BPE merge in that order, and
`ignore_merges` takes a piece that is a token whole, as tiktoken does first.

Converting a full-size vocabulary takes seconds (the merges are recovered in Python), and the
API process, the engine and the grammar compiler each load the tokenizer; so the converted
tokenizer.json is kept in tandem's cache directory (`TANDEM_CACHE_DIR`, else
`~/.cache/tandem`), under `tokenizers/`, keyed by the content of `tiktoken.model` and of the
special tokens, and later loads read it (about a third of the time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from tandem.platform.cache_dir import default_cache_dir
from tandem.tokenization.tokenizer_files import CONFIG_FILE, read_json

logger = logging.getLogger(__name__)

TIKTOKEN_FILE = "tiktoken.model"
# Ids after the BPE tokens that are special tokens (tokenization_kimi.py's
# `num_reserved_special_tokens`): 163584..163839 for Kimi's 163,584 BPE tokens.
RESERVED_SPECIAL_TOKENS = 256
RESERVED_TOKEN = "<|reserved_token_{}|>"

# How Kimi's tokenizer splits text before BPE (`pat_str` in tokenization_kimi.py): runs of Han
# characters; a word of other letters (optionally after one non-letter, non-digit character,
# lower-case letters last, or capitals first) with an English contraction; up to three digits;
# punctuation with the line breaks after it; line breaks; other whitespace.
_LETTERS_FIRST = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LAST = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_SPLIT_PATTERN = "|".join((
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_FIRST}*{_LETTERS_LAST}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_FIRST}+{_LETTERS_LAST}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
))

_CACHE_FORMAT = "1"  # bump when the converted tokenizer changes for the same files
_CACHE_SUBDIR = "tokenizers"


def has_tiktoken_model(hf_dir: Path) -> bool:
    return (Path(hf_dir) / TIKTOKEN_FILE).is_file()


def tiktoken_backend(hf_dir: Path, cache_dir: Path | None = None) -> Backend:
    """The `tokenizers` backend for `hf_dir`'s tiktoken.model, its special tokens registered at
    their ids; from the cache when this vocabulary was converted before.

    `cache_dir` is tandem's cache directory (default: `default_cache_dir()`).
    """
    hf_dir = Path(hf_dir)
    path = hf_dir / TIKTOKEN_FILE
    config_path = hf_dir / CONFIG_FILE
    config: dict[str, Any] = read_json(config_path) if config_path.is_file() else {}
    _warn_if_not_kimi(hf_dir, config)
    declared = config.get("added_tokens_decoder") or {}
    content = path.read_bytes()
    digest = hashlib.sha256(content).hexdigest()
    key = hashlib.sha256(
        "\n".join((_CACHE_FORMAT, digest, KIMI_SPLIT_PATTERN, json.dumps(declared, sort_keys=True))).encode()
    ).hexdigest()[:32]
    cache_file = _cache_root(cache_dir) / f"tiktoken-{key}.json"

    cached = _read_cached(cache_file, declared)
    if cached is not None:
        return cached
    started = time.perf_counter()
    ranks = _read_ranks(path, digest)
    backend = convert_ranks(ranks)
    _add_special_tokens(backend, special_tokens(declared, len(ranks)))
    logger.info("%s: %d BPE tokens converted from %s in %.1f s", hf_dir, len(ranks), TIKTOKEN_FILE,
                time.perf_counter() - started)
    _write_cache(cache_file, backend)
    return backend


def _read_ranks(path: Path, digest: str) -> dict[bytes, int]:
    """The ranks, read by tiktoken. tiktoken keeps a copy of every file it reads in a temporary
    directory keyed by the path alone and, without a hash, returns that copy: the hash makes it
    read this file's content, not an older file's at the same path."""
    from tiktoken.load import load_tiktoken_bpe  # only when converting: a cached load needs none

    return load_tiktoken_bpe(str(path), expected_hash=digest)


def _byte_to_unicode() -> list[str]:
    """The byte-level alphabet (GPT-2's, that of the `tokenizers` ByteLevel pre-tokenizer and
    decoder): printable Latin-1 bytes stand for themselves, the other bytes, in order, for the
    characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in table)
    table.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return [table[byte] for byte in range(256)]


def convert_ranks(ranks: dict[bytes, int], pattern: str = KIMI_SPLIT_PATTERN) -> Backend:
    """A byte-level BPE that encodes text as tiktoken does with these ranks and split pattern.

    The ranks must be the ids 0..n-1 (tiktoken's own files, Kimi's included, are), so that the
    BPE's ids are the ranks and the special tokens come right after.
    """
    count = len(ranks)
    words: list[str | None] = [None] * count
    alphabet = {byte: char for byte, char in enumerate(_byte_to_unicode())}
    for token, rank in ranks.items():
        if not 0 <= rank < count or words[rank] is not None:
            raise ValueError(f"{TIKTOKEN_FILE}: ranks are not the ids 0..{count - 1} (rank {rank})")
        words[rank] = token.decode("latin-1").translate(alphabet)
    vocab = {word: rank for rank, word in enumerate(words)}
    missing = [byte for byte, char in enumerate(_byte_to_unicode()) if char not in vocab]
    if missing:
        raise ValueError(f"{TIKTOKEN_FILE}: single bytes missing from the vocabulary: {missing[:8]}")

    # Every way a token splits into two tokens is a merge, in the token's rank order; among
    # one token's splits, tiktoken never has to choose (any of them gives that token), so the
    # order there only has to be fixed.
    merges: list[tuple[str, str]] = []
    rank_of = vocab.get
    for word in words:
        splits = []
        for cut in range(1, len(word)):
            left = rank_of(word[:cut])
            if left is not None:
                right = rank_of(word[cut:])
                if right is not None:
                    splits.append((left, right, cut))
        splits.sort()
        merges.extend((word[:cut], word[cut:]) for _, _, cut in splits)

    backend = Backend(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    return backend


def special_tokens(declared: dict[str, Any], base_size: int) -> list[AddedToken]:
    """The 256 special tokens at ids base_size onward, in id order: each id the config's
    `added_tokens_decoder` names has that token (and its flags), every other one is
    `<|reserved_token_ID|>` (special), as tokenization_kimi.py names them."""
    last = base_size + RESERVED_SPECIAL_TOKENS - 1
    by_id: dict[int, AddedToken] = {}
    for index, token in declared.items():
        index = int(index)
        if not base_size <= index <= last:
            raise ValueError(f"{CONFIG_FILE}: added token {index} ({token!r}) is not one of the special ids "
                             f"{base_size}..{last} after the {base_size} tokens of {TIKTOKEN_FILE}")
        fields = {name: value for name, value in token.items() if name != "__type"} if isinstance(token, dict) \
            else {"content": str(token), "special": True}
        fields.setdefault("normalized", False)
        by_id[index] = AddedToken(**fields)
    return [by_id.get(index) or AddedToken(RESERVED_TOKEN.format(index), special=True, normalized=False)
            for index in range(base_size, last + 1)]


def _add_special_tokens(backend: Backend, tokens: list[AddedToken]) -> None:
    backend.add_tokens(tokens)
    _check_ids(backend, tokens)


def _check_ids(backend: Backend, tokens: list[AddedToken]) -> None:
    """Each special token at its id (the BPE holds ids 0..n-1, the special tokens follow)."""
    base = backend.get_vocab_size(with_added_tokens=False)
    for index, token in enumerate(tokens, start=base):
        found = backend.token_to_id(token.content)
        if found != index:
            raise ValueError(f"{TIKTOKEN_FILE}: special token {token.content!r} would be id {found}, not {index} "
                             "(its text is also a BPE token, or the ranks are not 0..n-1)")


def _warn_if_not_kimi(hf_dir: Path, config: dict[str, Any]) -> None:
    auto_map = config.get("auto_map") or {}
    names = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    names = names if isinstance(names, (list, tuple)) else [names]
    if not any(isinstance(name, str) and name.startswith("tokenization_kimi.") for name in names):
        logger.warning("%s: %s is read as Kimi's tokenizer (its split pattern and 256 special tokens); "
                       "this directory's %s does not name tokenization_kimi", hf_dir, TIKTOKEN_FILE, CONFIG_FILE)


# --- the cache of converted vocabularies ---------------------------------------------------------
def _cache_root(cache_dir: Path | None) -> Path:
    if cache_dir is None:
        cache_dir = default_cache_dir()
    return Path(cache_dir) / _CACHE_SUBDIR


def _read_cached(cache_file: Path, declared: dict[str, Any]) -> Backend | None:
    if not cache_file.is_file():
        return None
    try:
        backend = Backend.from_file(str(cache_file))
        _check_ids(backend, special_tokens(declared, backend.get_vocab_size(with_added_tokens=False)))
    except Exception as exc:  # a damaged or foreign file: convert again (and replace it)
        logger.warning("%s: not a usable converted tokenizer (%s); converting again", cache_file, exc)
        return None
    return backend


def _write_cache(cache_file: Path, backend: Backend) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=".converting-", suffix=".json", dir=cache_file.parent)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(backend.to_str())
            os.chmod(staging, 0o644)  # mkstemp's 0600 would keep it from other users of the cache
            os.replace(staging, cache_file)  # whole or not at all, even with another process at it
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
    except OSError as exc:
        logger.info("could not keep the converted tokenizer in %s (%s); it is converted on each load",
                    cache_file.parent, exc)
