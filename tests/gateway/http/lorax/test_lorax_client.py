"""The official ``lorax-client`` package from PyPI against the gateway's LoRAX routes on a real
mesh (fp32 workers): its greedy stream from an adapter, and its whole generation, equal the
SDK's greedy generation token for token; its refusals arrive as its own exception classes.

``lorax-client`` pins an old ``huggingface-hub``, so it lives in a virtual environment of its
own, ``.venv-lorax/`` in the checkout (git-ignored), made once and reused; the client runs there
as a script and reports what it saw as JSON. Without PyPI the test is skipped, saying why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loramesh import Client

pytestmark = [pytest.mark.integration, pytest.mark.model]

REPO = Path(__file__).resolve().parents[4]
LORAX_VENV = REPO / ".venv-lorax"
LORAX_CLIENT = ("lorax-client", "0.6.3")
"""The release tested; it posts every generation to the base URL (LoRAX's ``POST /``)."""
HANG_GUARD_S = 600
"""Not a timing claim: only turns a hung pip or client into a named failure."""
PROMPT = "The three primary colours are"
MAX_NEW_TOKENS = 12

#: Runs in the lorax-client environment: argv is base URL, API key, adapter, prompt, max tokens.
CLIENT_SCRIPT = """
import json, sys
from lorax import Client
from lorax.errors import NotFoundError, ValidationError

base_url, key, adapter, prompt, max_new_tokens = sys.argv[1:6]
client = Client(base_url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
ask = dict(adapter_id=adapter, max_new_tokens=int(max_new_tokens), do_sample=False)
stream = list(client.generate_stream(prompt, **ask))
whole = client.generate(prompt, **ask)
refusals = {}
for name, call, expected in (
    ("unknown adapter", lambda: client.generate(prompt, adapter_id="nobody/nothing"), NotFoundError),
    ("typical_p", lambda: client.generate(prompt, typical_p=0.5), ValidationError),
):
    try:
        call()
        refusals[name] = "accepted"
    except expected as error:
        refusals[name] = str(error)
print(json.dumps({
    "streamed_text": "".join(r.token.text for r in stream if not r.token.special),
    "streamed_ids": [r.token.id for r in stream],
    "stream_generated_text": stream[-1].generated_text,
    "stream_details": stream[-1].details.model_dump(mode="json"),
    "generated_text": whole.generated_text,
    "details_ids": [t.id for t in whole.details.tokens],
    "finish_reason": whole.details.finish_reason,
    "refusals": refusals,
}))
"""


def _installed(python: Path) -> str | None:
    """The lorax-client version ``python`` has, None if it has none (or does not run)."""
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({LORAX_CLIENT[0]!r}))"],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S,
    )  # fmt: skip
    return probe.stdout.strip() if probe.returncode == 0 else None


@pytest.fixture(scope="session")
def lorax_python() -> Path:
    """The Python of ``.venv-lorax``, made with the pinned lorax-client on first use."""
    python = LORAX_VENV / "bin" / "python"
    name, version = LORAX_CLIENT
    if _installed(python) == version:
        return python
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--clear", str(LORAX_VENV)],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert made.returncode == 0, made.stdout + made.stderr
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", f"{name}=={version}"],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S,
    )  # fmt: skip
    if installed.returncode != 0:
        pytest.skip(
            f"cannot install {name}=={version} from the package index: {installed.stderr.strip()[-500:]}"
        )
    return python


def run_lorax_client(python: Path, base_url: str, key: str, adapter: str) -> dict:
    ran = subprocess.run(
        [str(python), "-c", CLIENT_SCRIPT, base_url, key, adapter, PROMPT, str(MAX_NEW_TOKENS)],
        capture_output=True, text=True, check=False, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)


def test_lorax_client_streams_an_adapters_greedy_text_equal_to_the_sdks(mesh, lorax_python):
    root = mesh.openai_base_url.removesuffix("/v1")
    seen = run_lorax_client(lorax_python, root, "key-alice", "pirate")
    with Client(mesh.gateway.address, "key-alice") as sdk:
        expected = sdk.generate(PROMPT, adapter="pirate", max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        base = sdk.generate(PROMPT, max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    assert expected.text != base.text  # the adapter changes the greedy text: it was applied
    assert seen["streamed_text"] == seen["stream_generated_text"] == expected.text
    assert seen["streamed_ids"] == seen["details_ids"] == list(expected.token_ids)
    assert seen["generated_text"] == expected.text
    assert seen["finish_reason"] == {"length": "length", "stop": "eos_token"}[expected.finish_reason]
    assert seen["stream_details"] == {
        "finish_reason": seen["finish_reason"],
        "prompt_tokens": expected.usage.prompt_tokens,
        "generated_tokens": len(expected.token_ids),
        "seed": None,
    }
    assert "adapter_id" in seen["refusals"]["unknown adapter"]
    assert "typical_p is not supported" in seen["refusals"]["typical_p"]
