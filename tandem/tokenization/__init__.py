"""Tokenizer files read without torch: what the workers' tokenizer (loader/tokenizer.py) and
the router's prompt counter (router/placement/prompt_tokens.py) both need, so the router can
count a Kimi directory's prompts without importing the torch side."""
