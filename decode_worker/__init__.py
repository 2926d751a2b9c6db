"""Decode worker: a Ray actor that receives prompt KV and runs continuous-batching decode."""
