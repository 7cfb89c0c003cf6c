"""Constrained decoding (structured outputs): grammars compiled with llguidance, matched on
the host per emitted token, applied to the logits as a token bitmask."""
