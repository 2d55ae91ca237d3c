"""Server-sent events as every dialect frames them: one JSON payload per ``data:`` line."""

from __future__ import annotations

import json


def sse(payload: dict) -> bytes:
    # Compact and UTF-8 as is: one event per token, so every byte counts.
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
