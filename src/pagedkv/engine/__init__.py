"""The engine: requests, the torch-free scheduler, the model runner, sampling and `LLM`.

Nothing is imported here, so `pagedkv.engine.scheduler` and `pagedkv.engine.request` stay
importable without torch; the public names are re-exported by `pagedkv`.
"""
