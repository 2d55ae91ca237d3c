"""``loramesh demo`` (``make demo``): three small real LoRA adapters that visibly do something (answer in French, talk
like a pirate, end with a SQL query), served by a local mesh next to the base model.

Steps: train the adapters with peft on CPU (once; then cached, see ``demo_adapters``), start a
mesh with 2 workers, upload them, ask the base model and each adapter the same questions through
the ``openai`` client (streaming chat completions) and through the SDK (concurrently, with a
latency table), print a curl + SSE example with the mesh's real address and key and run it
exactly as printed, then stop the mesh (``--keep-up`` leaves it running to try the example).

Everything goes through what a user touches: the ``loramesh`` CLI, the ``openai`` package, the
SDK and curl. Training (torch, peft), the CLI and ``openai`` are imported only when their step
runs, so importing this module stays light.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from loramesh.client import STATE_DIR_ENV

BASE = "(base)"
MAX_TOKENS = 48
CURL_MAX_TOKENS = 12
CHECK_MARK = {True: "same as via openai", False: "differs from openai"}

UP_ARGS = ("up", "--detach", "--workers", "2", "--pool-mib", "256", "--dtype", "float32")
"""How the demo starts its mesh: in float32, so the replies README.md prints are the ones a
reader's run prints (``--dtype auto`` computes in bfloat16 on CPUs with native bf16)."""


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def run(*argv: str) -> None:
    from loramesh_cli.main import main as loramesh

    print("$ loramesh " + " ".join(argv), flush=True)
    if loramesh(list(argv)) != 0:
        raise SystemExit(f"demo failed at: loramesh {' '.join(argv)}")


def demo_adapters() -> tuple[dict[str, Path], tuple[str, ...]]:
    """The trained adapters' folders (trained now or found cached) and the demo's questions."""
    try:
        from demo_adapters.cache import ensure_adapters
        from demo_adapters.data import DEMO_QUESTIONS
    except ImportError as error:
        raise SystemExit(f"the demo adapters are trained by demo_adapters/ in the repository: "
                         f"run `make demo` from its root ({error})") from error  # fmt: skip
    return ensure_adapters(log=lambda line: print(line, flush=True)), DEMO_QUESTIONS


def already_registered(names: list[str]) -> list[str]:
    """Which of ``names`` the admin tenant (mesh.json's key, the CLI's default) already has: a
    model id is the bare name only for the caller's own adapters (``owner/name`` for others'
    public ones, which ``loramesh adapters delete`` could not delete)."""
    from loramesh.client import Client

    with Client() as client:
        return [m.id for m in client.models() if m.id in names]


def mesh_endpoints() -> tuple[str, str, str]:
    """``(OpenAI base URL, admin API key, base model id)`` of the mesh ``loramesh up`` started."""
    from loramesh.client import default_state_dir
    from loramesh_cli.mesh_file import MeshFile

    # Where `loramesh up` above wrote it: --state-dir's default, $LORAMESH_STATE_DIR or .loramesh.
    mesh_file = MeshFile.path(default_state_dir()).absolute()
    mesh = MeshFile.read(default_state_dir())
    if mesh is None:
        raise SystemExit(f"no {mesh_file}: the mesh did not start")
    openai_address = next((s.openai_address for s in mesh.services.values() if s.openai_address), "")
    if not openai_address:
        raise SystemExit(f"the mesh serves no OpenAI API (no openai_address in {mesh_file})")
    from openai import OpenAI

    base_url = f"http://{openai_address}/v1"
    with OpenAI(base_url=base_url, api_key=mesh.admin_api_key) as client:
        # GET /v1/models lists the base model (no parent) and the adapters (the base as parent).
        base_model = next(m.id for m in client.models.list() if getattr(m, "parent", None) is None)
    return base_url, mesh.admin_api_key, base_model


def ask_through_openai(
    base_url: str, api_key: str, base_model: str, question: str, models: list[str]
) -> dict:
    """Stream ``question`` to each model (greedy) through the ``openai`` client, printing as it
    comes; returns model -> answer."""
    from openai import OpenAI

    answers = {}
    with OpenAI(base_url=base_url, api_key=api_key) as client:
        print(f"\nQ: {question}")
        for model in models:
            print(f"  {model:>8} → ", end="", flush=True)
            stream = client.chat.completions.create(
                model=base_model if model == BASE else model,
                messages=[{"role": "user", "content": question}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
            )
            parts = []
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    parts.append(chunk.choices[0].delta.content)
                    print(indent(chunk.choices[0].delta.content), end="", flush=True)
            answers[model] = "".join(parts)
            print(flush=True)
    return answers


def indent(text: str) -> str:
    """Continuation lines of a multi-line answer start under its first line."""
    return text.replace("\n", "\n" + " " * 13)


async def one_sdk_request(client, question: str, model: str) -> dict:
    started = time.perf_counter()
    first = None
    text, usage = [], None
    adapter = None if model == BASE else model
    messages = [{"role": "user", "content": question}]
    async for delta in client.chat_stream(messages, adapter=adapter, max_tokens=MAX_TOKENS, temperature=0):
        if first is None and delta.token_ids:
            first = time.perf_counter() - started
        text.append(delta.text)
        usage = delta.usage or usage
    total = time.perf_counter() - started
    return {"model": model, "question": question, "answer": "".join(text), "first_token_s": first or total,
            "total_s": total, "tokens": usage.completion_tokens if usage else 0}  # fmt: skip


async def ask_through_sdk(questions: tuple[str, ...], models: list[str]) -> list[dict]:
    """Every question to every model at once through the SDK's ``AsyncClient``."""
    from loramesh.async_client import AsyncClient

    async with AsyncClient() as client:
        return await asyncio.gather(*(one_sdk_request(client, q, m) for q in questions for m in models))


def print_sdk_answers(results: list[dict], via_openai: dict[str, dict[str, str]], wall_s: float) -> None:
    for question in dict.fromkeys(r["question"] for r in results):
        print(f"\nQ: {question}")
        for r in (r for r in results if r["question"] == question):
            checked = via_openai.get(question, {}).get(r["model"])
            mark = f"   [{CHECK_MARK[checked == r['answer']]}]" if checked is not None else ""
            print(f"  {r['model']:>8} → {indent(r['answer'])}{mark}")
    print(f"\n{'model':>8}  {'first token':>11}  {'total':>7}  {'tokens':>6}  {'tok/s':>6}  question")
    for r in results:
        rate = r["tokens"] / r["total_s"] if r["total_s"] else 0.0
        print(f"{r['model']:>8}  {r['first_token_s'] * 1000:>8.0f} ms  {r['total_s']:>5.2f} s  "
              f"{r['tokens']:>6}  {rate:>6.1f}  {r['question']}")  # fmt: skip
    generated = sum(r["tokens"] for r in results)
    print(f"\n{len(results)} concurrent requests, {generated} tokens in {wall_s:.1f} s: "
          f"{generated / wall_s:.1f} tokens/s overall")  # fmt: skip


def curl_example(base_url: str, api_key: str, model: str, question: str) -> str:
    """A curl command streaming one chat completion as server-sent events."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": CURL_MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    return (
        f"curl -sN {base_url}/chat/completions \\\n"
        f"  -H 'Authorization: Bearer {api_key}' -H 'Content-Type: application/json' \\\n"
        f"  -d {shlex.quote(json.dumps(body))}"
    )


def run_as_printed(command: str) -> None:
    """Print ``command``, then run exactly that text in a shell and show what it prints."""
    print(command)
    if shutil.which("curl") is None:
        print("(curl is not installed here, so the demo does not run it)")
        return
    print("\nwhich prints:")
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, check=False)
    print(result.stdout.rstrip())
    if result.returncode != 0:
        raise SystemExit(f"the curl example failed ({result.returncode}): {result.stderr.strip()}")


def add_demo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keep-up",
        action="store_true",
        help="leave the mesh running (`loramesh down` stops it; default off)",
    )


def add_parsers(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="three trained demo adapters (French, pirate, SQL) served next to the base model on a "
        "local mesh, through the openai client, the SDK and curl (needs a checkout: make demo)",
    )
    add_demo_flags(demo)
    demo.set_defaults(func=cmd_demo)


def main(argv: list[str] | None = None) -> int:
    """``python -m loramesh_cli.demo``: what ``loramesh demo`` runs."""
    parser = argparse.ArgumentParser(prog="python -m loramesh_cli.demo", description=__doc__.split("\n\n")[0])
    add_demo_flags(parser)
    return cmd_demo(parser.parse_args(argv))


def cmd_demo(args) -> int:
    if getattr(args, "state_dir", None):  # `loramesh --state-dir DIR demo`: every step's mesh is there
        os.environ[STATE_DIR_ENV] = str(args.state_dir)
    step("demo adapters: french, pirate, sql (LoRA r=8 on SmolLM2-135M-Instruct, trained with peft on CPU)")
    adapters, questions = demo_adapters()
    models = [BASE, *adapters]
    step("start the mesh: etcd, adapter store, 2 workers, scheduler, gateway")
    run(*UP_ARGS)
    try:
        step(f"upload the {len(adapters)} adapters")
        for name in already_registered(list(adapters)):  # a previous demo's, kept by the store
            run("adapters", "delete", name)
        for name, directory in adapters.items():
            run("adapters", "upload", str(directory), "--name", name)
        run("adapters", "list")
        step("one streamed completion through the CLI")
        run("chat", "--adapter", "pirate", "--max-tokens", "32", questions[-1])
        base_url, api_key, base_model = mesh_endpoints()
        step(f"the same question to the base model and each adapter: openai client, streaming ({base_url})")
        via_openai = {questions[0]: ask_through_openai(base_url, api_key, base_model, questions[0], models)}
        step(f"{len(questions)} questions x {len(models)} models at once through the SDK (AsyncClient)")
        started = time.perf_counter()
        results = asyncio.run(ask_through_sdk(questions, models))
        print_sdk_answers(results, via_openai, time.perf_counter() - started)
        step("curl + server-sent events, exactly as printed (while the mesh is up)")
        run_as_printed(curl_example(base_url, api_key, "pirate", questions[1]))
        step("mesh status")
        time.sleep(1.2)  # load reports are written every second; show one taken after the traffic
        run("status")
    finally:
        if args.keep_up:
            step("the mesh stays up: try the curl above, then `loramesh down`")
        else:
            step("stop the mesh")
            run("down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
