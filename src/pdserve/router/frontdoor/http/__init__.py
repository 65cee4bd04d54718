"""The router's OpenAI-compatible HTTP API (Starlette + uvicorn on the router's loop)."""
