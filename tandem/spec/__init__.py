"""Speculative decoding: proposers guess a request's next tokens, the target verifies them."""
