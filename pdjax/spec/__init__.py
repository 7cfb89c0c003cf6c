"""Speculative decoding (DESIGN.md §3, "Speculative decoding"): drafters propose tokens on the
host, the model verifies them as ragged extend rows of the same bucketed forward, and the
device's sampler keeps the longest prefix the target agrees with, plus one token of its own."""
