"""The OpenAI-compatible HTTP server (Litestar + msgspec); `create_app` in app.py builds it."""
