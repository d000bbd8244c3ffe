"""The OpenAI-compatible server and the `serve`/`generate` commands.

`api.create_app(AsyncEngine, model_name=...)` builds the FastAPI app; `async_engine.AsyncEngine`
runs an `LLMEngine` on its own thread. Nothing heavy is imported here, so the CLI's
`--help` never loads torch or FastAPI.
"""
