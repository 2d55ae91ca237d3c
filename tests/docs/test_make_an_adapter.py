"""docs/make-an-adapter.md, run as a user runs it: its Python trains and saves a PEFT adapter, its
shell commands upload that adapter to a `loramesh up` mesh and ask it, and the mesh (float32)
replies what transformers + peft reply on the same weights."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import COMMAND_TIMEOUT_S, loramesh

from services.adapter_store.validation import ValidationLimits, validate_adapter

pytestmark = [pytest.mark.integration, pytest.mark.model]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "make-an-adapter.md"

#: Appended to the page's Python: what peft answers, greedy, to the question the page's `loramesh
#: chat` asks, through the same chat template the gateway renders.
PEFT_REPLY = """
peft_model.eval()
question = {question!r}
prompt = tokenizer.apply_chat_template(
    [{{"role": "user", "content": question}}], add_generation_prompt=True, tokenize=False
)
ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
with torch.no_grad():
    out = peft_model.generate(ids, max_new_tokens={max_tokens}, do_sample=False)
Path("peft-reply.txt").write_text(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
"""


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.DOTALL)


def test_the_page_trains_an_adapter_the_mesh_serves_as_peft_does(tmp_path, base_spec):
    commands = [shlex.split(line) for block in blocks("sh") for line in block.splitlines() if line.strip()]
    upload, chat = commands
    assert upload[:3] == ["loramesh", "adapters", "upload"] and chat[:2] == ["loramesh", "chat"]
    question, max_tokens = chat[-1], int(chat[chat.index("--max-tokens") + 1])

    script = "\n".join(blocks("python")) + PEFT_REPLY.format(question=question, max_tokens=max_tokens)
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=COMMAND_TIMEOUT_S)
    adapter = tmp_path / upload[3]
    validated = validate_adapter(
        (adapter / "adapter_config.json").read_bytes(),
        (adapter / "adapter_model.safetensors").read_bytes(),
        base_spec,
        ValidationLimits(),
    )
    assert validated.config.rank == 8 and len(validated.target_modules) == 7
    peft_reply = (tmp_path / "peft-reply.txt").read_text()
    assert peft_reply.startswith("ROGER."), peft_reply  # the page's training taught its style

    # The page's commands, word for word, from the directory the Python ran in; the mesh's state
    # is that directory's .loramesh, the default when nothing names another.
    state = tmp_path / ".loramesh"
    loramesh(state, "up", "--detach", "--workers", "1", "--dtype", "float32", "--pool-mib", "64")
    env = {key: value for key, value in os.environ.items() if key != "LORAMESH_STATE_DIR"}
    try:
        replies = [
            subprocess.run(
                [sys.executable, "-m", "loramesh_cli.main", *command[1:]],
                check=False,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
            )
            for command in (upload, chat)
        ]
    finally:
        loramesh(state, "down", check=False)
    uploaded, answered = replies
    assert uploaded.returncode == 0 and "registered admin/my-adapter" in uploaded.stdout, uploaded.stderr
    assert answered.returncode == 0, answered.stderr
    assert answered.stdout.strip() == peft_reply.strip()
