"""Grammar-constrained decoding: what a request's output must match, as a token mask per step.

`grammar.py` turns a request's `GuidedDecoding` into an llguidance grammar (and refuses a bad
one with a message); `constraints.py` holds a matcher per constrained sequence in the engine
core, beside the scheduler: it checks drafts, fills the batch's token masks off the critical
path, advances with the tokens kept and finds forced tokens (jump-forward). The worker only
applies the masks (tandem/layers/token_mask.py). Torch-free.
"""
