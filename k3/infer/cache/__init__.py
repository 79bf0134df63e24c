"""The engine's memory of past tokens: pages and slots with their refcounts (`block_manager`), the exact
prefix cache over them (`prefix_cache`), and the paged MLA latents the model reads (`paged_mla`)."""
