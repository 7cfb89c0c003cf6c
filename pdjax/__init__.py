"""pdjax: JAX/XLA LLM serving with prefill/decode disaggregation and mixed batching.

Importing the package stays light (no JAX import); ``pdjax.Engine`` is loaded on first use.
"""

__all__ = ["Engine"]


def __getattr__(name):
    if name == "Engine":
        from pdjax.engine import Engine

        return Engine
    raise AttributeError(f"module 'pdjax' has no attribute {name!r}")
