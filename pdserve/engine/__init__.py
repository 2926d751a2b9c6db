"""The single-process engine: model, paged KV cache, scheduler, sampling (no network, no Ray)."""
