"""Exports for other engines: the release's safetensors layout (`hf`) and llama.cpp's GGUF (`gguf`).

`k3 export` (k3/export/cli.py) is the command; docs/interop.md and docs/gguf.md are the user's pages.
"""
