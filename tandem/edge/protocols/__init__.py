"""The agent protocols tandem speaks besides Chat Completions, translated at the edge.

Anthropic's Messages API (`/v1/messages`, Claude Code) and OpenAI's Responses API
(`/v1/responses`, Codex) are each an adapter (`base.ProtocolAdapter`) between the client's
protocol and one internal form: a Chat Completions request, whose reply and stream chunks the
adapter turns back into the client's protocol. The server (`tandem serve`) and the router
(`tandem route`) use the same adapters, so below the HTTP edge nothing knows which protocol
a request came in on: the router's direct, prefill/decode and migration paths, the engine,
the tool-call parsers and the prefix cache all see a chat request.

Torch-free, like the rest of tandem.edge: the router imports it.
"""
