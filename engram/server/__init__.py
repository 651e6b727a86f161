"""The OpenAI-compatible server (``engram serve``); see docs/server.md. Importing this package is cheap (no
FastAPI): the CLI reads its defaults while building the parser."""

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # request bodies larger than this get 413 (--max-request-bytes)
