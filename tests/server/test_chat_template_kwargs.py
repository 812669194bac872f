"""`chat_template_kwargs` (vLLM's field): template variables from the request, such as Qwen3's
`enable_thinking`, reach the chat template; the renderer's own arguments cannot be set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tandem.edge.openai_protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from tandem.loader.tokenizer import Tokenizer
from tandem.server.chat_prompt import render_chat_prompt
from tandem.server.reasoning.think_tags import leaves_block_open
from tandem.server.tool_parsers import HermesToolParser
from tests.support.tokenizers import smollm_tokenizer_with

# Qwen3's way: asked not to think, the template writes an empty block itself.
TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n"
            "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{%- endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return smollm_tokenizer_with(tmp_path_factory.mktemp("qwen3-like"), chat_template=TEMPLATE)


def render(tokenizer: Tokenizer, kwargs: dict | None) -> str:
    messages = [ChatMessage(role="user", content="Hi")]
    return render_chat_prompt(tokenizer, messages, None, None, HermesToolParser(), template_kwargs=kwargs).text


def test_a_template_variable_reaches_the_template(tokenizer: Tokenizer) -> None:
    thinking = render(tokenizer, None)
    quiet = render(tokenizer, {"enable_thinking": False})
    assert quiet == thinking + "<think>\n\n</think>\n\n"
    assert render(tokenizer, {"enable_thinking": True}) == thinking
    assert not leaves_block_open(quiet)  # the reasoning parser then reads the output as answer


@pytest.mark.parametrize("kwargs", [
    {"add_generation_prompt": False}, {"tools": []}, {"messages": []}, {"tokenize": True},
    {"not an identifier": 1}, {f"k{i}": i for i in range(33)},
], ids=["add_generation_prompt", "tools", "messages", "tokenize", "name", "too-many"])
def test_the_renderers_own_arguments_are_refused(kwargs: dict) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": kwargs}
    with pytest.raises(ValidationError, match="chat_template_kwargs"):
        ChatCompletionRequest.model_validate(body)
    with pytest.raises(ValidationError, match="chat_template_kwargs"):
        TokenizeRequest.model_validate(body)
    assert ChatCompletionRequest.model_validate({**body, "chat_template_kwargs": {"enable_thinking": False}})


def test_the_server_takes_them_and_refuses_reserved_ones_with_a_400(tandem_server: str) -> None:
    import httpx

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    ok = httpx.post(f"{tandem_server}/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}},
                    timeout=120)
    assert ok.status_code == 200, ok.text
    bad = httpx.post(f"{tandem_server}/v1/chat/completions", json={**body, "chat_template_kwargs": {"tools": []}},
                     timeout=120)
    assert bad.status_code == 400 and "chat_template_kwargs" in bad.json()["error"]["message"]
