"""How the router survives failing workers and overload: stream migration limits, circuit
breakers, the retry budget, admission control and drain (flags shared with `tandem up`)."""
