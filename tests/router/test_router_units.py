"""Router-wide pieces without processes: the torch-free import, and config (worker files, URLs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.router.config import (
    WorkerSpec,
    normalize_url,
    parse_worker_file,
    read_worker_file,
    specs_from_lists,
)


# --- imports ---------------------------------------------------------------------------
def test_router_app_does_not_import_torch() -> None:
    # tandem.kvcache.block_hash (xxhash only) is the one engine module the router may use.
    code = (
        "import sys, tandem.router.http.app, tandem.router.cli; "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        "or (m.startswith('tandem.engine') and m not in ('tandem.engine', "
        "'tandem.kvcache.block_hash')) or m.startswith('tandem.server')]; print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"




# --- config ----------------------------------------------------------------------------
def test_worker_file_json_and_yaml(tmp_path: Path) -> None:
    data = {
        "prefill": ["127.0.0.1:9001"],
        "decode": ["http://127.0.0.1:9002/v1/"],
        "worker": [{"url": "http://h:9003"}],
    }
    expected = (
        WorkerSpec("http://127.0.0.1:9001", "prefill"),
        WorkerSpec("http://127.0.0.1:9002", "decode"),
        WorkerSpec("http://h:9003", "both"),
    )
    path = tmp_path / "workers.json"
    path.write_text(json.dumps(data))
    assert read_worker_file(path) == expected
    yaml_text = (
        "prefill:\n  - 127.0.0.1:9001\ndecode: [http://127.0.0.1:9002/v1/]\n"
        "worker:\n  - url: http://h:9003\n"
    )
    assert parse_worker_file(yaml_text, ".yaml") == expected
    assert parse_worker_file("", ".json") == ()


def test_worker_file_errors() -> None:
    with pytest.raises(ValueError, match="unknown key 'decoder'"):
        parse_worker_file('{"decoder": ["http://a"]}')
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_worker_file("{prefill: ")
    with pytest.raises(ValueError, match="mapping"):
        parse_worker_file('["http://a"]')


def test_urls_are_normalized_and_deduplicated() -> None:
    assert normalize_url("localhost:8001/") == "http://localhost:8001"
    assert specs_from_lists(["a:1", "http://a:1/v1"], [], []) == (
        WorkerSpec("http://a:1", "prefill"),
    )


def test_malformed_bodies_that_fuzzing_found_do_not_break_prompt_counting() -> None:
    """Each once made the router answer 500: a content part whose text is a list, tool_calls
    that is not a list, token ids no vocabulary has (they broke the block hashing)."""
    from tandem.router.placement.prompt_tokens import chat_text
    from tandem.router.placement.tokenize import token_id_prompt

    assert chat_text({"messages": [{"role": "system", "content": [{"type": "", "text": [None]}]}]}) == ""
    assert chat_text({"messages": [{"role": "user", "content": "hi", "tool_calls": 5}]}) == "hi"
    assert chat_text({"messages": 7}) == ""
    assert token_id_prompt({"prompt": [-1, 5]}, "completion") is None
    assert token_id_prompt({"prompt": [1 << 40]}, "completion") is None
    assert token_id_prompt({"prompt": [[3, 4]]}, "completion") == [3, 4]
