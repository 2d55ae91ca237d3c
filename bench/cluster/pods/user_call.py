"""A user's calls through the gateway Service, from a pod: upload an adapter, then stream a
greedy completion with it; one JSON line on stdout. Run inside a pod's network namespace
(``OverlayRun`` ``exec_in``), where the Service's names resolve and its ClusterIP is translated:

``python -m bench.cluster.pods.user_call --gateway gateway.loramesh.svc.cluster.local:50050
--api-key KEY --tls CA CERT KEY --adapter-dir DIR --name NAME --prompt TEXT --max-tokens N``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from loramesh import AsyncClient
from loramesh.tls import ClientTLS

MESH_SERVER_NAME = "mesh.loramesh"
"""What every mesh certificate names: the Service name is checked as this one."""


async def call(args: argparse.Namespace) -> dict:
    tls = ClientTLS(*args.tls, server_name=MESH_SERVER_NAME)
    async with AsyncClient(args.gateway, args.api_key, tls=tls, timeout=args.timeout_s) as client:
        adapter = await client.adapters.upload(args.adapter_dir, args.name)
        tokens, text, finish, usage = [], "", None, None
        async for delta in client.stream(
            args.prompt, adapter=args.name, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
        ):
            tokens += delta.token_ids
            text += delta.text
            finish, usage = delta.finish_reason or finish, delta.usage or usage
    return {"adapter": adapter.name, "token_ids": tokens, "text": text, "finish_reason": finish,
            "prompt_tokens": usage.prompt_tokens if usage else None}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.pods.user_call")
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--tls", nargs=3, metavar=("CA", "CERT", "KEY"), required=True)
    parser.add_argument("--adapter-dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a hang guard on each call")
    print(json.dumps(asyncio.run(call(parser.parse_args(argv)))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
