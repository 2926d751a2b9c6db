"""pdserve: a prefill/decode disaggregated LLM serving cluster."""

__version__ = "0.1.0"
