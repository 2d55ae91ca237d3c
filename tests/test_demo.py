"""``loramesh_cli.demo``: light to import, and a curl example that is valid shell carrying valid JSON."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from loramesh_cli.demo import curl_example


def test_importing_the_demo_loads_no_training_server_or_http_client_code():
    heavy = ("torch", "peft", "transformers", "openai", "services", "demo_adapters")
    code = f"import sys, loramesh_cli.demo; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_curl_example_is_one_shell_command_with_the_request_as_json():
    command = curl_example("http://127.0.0.1:8000/v1", "lm-key", "pirate", 'What\'s up? "quoted"')
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:3] == ["curl", "-sN", "http://127.0.0.1:8000/v1/chat/completions"]
    assert words[words.index("-H") + 1] == "Authorization: Bearer lm-key"
    body = json.loads(words[words.index("-d") + 1])
    assert body["model"] == "pirate" and body["stream"] is True
    assert body["messages"] == [{"role": "user", "content": 'What\'s up? "quoted"'}]
