"""Prefill worker: a Ray actor that computes prompt KV and streams it, layer by layer, to a decode worker."""
