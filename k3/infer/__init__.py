"""Inference engine: paged MLA latents, per-slot KDA states, an exact hybrid prefix cache.

Request flow: `Engine.add_request` -> `Scheduler` (continuous batching, chunked prefill, preemption;
pure Python) -> `ModelRunner` (owns the device caches, calls the model) -> `sampler` -> outputs.
Rooms: the engine core here (engine, scheduler, sequence, sampler, config, model_runner,
async_engine); `cache/` (page and slot pools, prefix cache, paged MLA state); `decode/` (the torch and
the native decode step, one chosen when the engine is built); `memory` (heap thresholds, huge pages);
`media` and `vision` (image embeddings in the prompt; the VL front end).
"""
