"""OpenAI-compatible HTTP server (FastAPI + uvicorn) and terminal chat on the k3 inference engine."""
