"""``loramesh generate`` and ``loramesh chat``: text through the gateway, streamed to stdout.

Only generated text goes to stdout (pipe it anywhere); usage and timings go to stderr.
"""

from __future__ import annotations

import sys

from loramesh_cli.errors import CommandError
from loramesh_cli.gateway_client import add_connection_flags, gateway_client

DEFAULT_TIMEOUT_S = 60.0
"""The SDK client's own default for a call, a stream's whole duration included."""


def add_parsers(sub) -> None:
    for name, help_text in (("generate", "raw completion of a prompt (no chat template)"),
                            ("chat", "chat through the model's template; no message = interactive")):  # fmt: skip
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument(
            "--adapter",
            default="",
            metavar="NAME",
            help="adapter name, or owner/name of a public one (default none: the base model)",
        )
        cmd.add_argument(
            "--max-tokens",
            type=int,
            default=None,
            metavar="N",
            help="tokens to generate at most (default: the gateway's --default-max-tokens, 128)",
        )
        cmd.add_argument(
            "--temperature",
            type=float,
            default=None,
            metavar="T",
            help="0 decodes greedily; above 0 samples, the logits divided by T (default 0)",
        )
        cmd.add_argument(
            "--top-p",
            type=float,
            default=None,
            metavar="P",
            help="sample from the smallest set of tokens whose probability adds up to P (default 1: off)",
        )
        cmd.add_argument(
            "--top-k",
            type=int,
            default=None,
            metavar="K",
            help="sample from the K most likely tokens (default 0: off)",
        )
        cmd.add_argument(
            "--seed", type=int, default=None, metavar="N", help="makes sampling reproducible (default none)"
        )
        cmd.add_argument(
            "--stop",
            action="append",
            default=None,
            metavar="TEXT",
            help="a string that ends the generation, repeatable (default none)",
        )
        cmd.add_argument(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT_S,
            metavar="S",
            help=f"seconds the whole generation may take, first token to last (default {DEFAULT_TIMEOUT_S:g}); "
            "a long prompt on a busy CPU worker may need more",
        )
        add_connection_flags(cmd)
        if name == "generate":
            cmd.add_argument("prompt", help="the text to complete")
            cmd.set_defaults(func=cmd_generate)
        else:
            cmd.add_argument("--system", default="", metavar="TEXT", help="system message (default none)")
            cmd.add_argument(
                "message",
                nargs="?",
                default=None,
                help="the user's message; without it, an interactive chat on stdin",
            )
            cmd.set_defaults(func=cmd_chat)


def _options(args) -> dict:
    if args.timeout <= 0:
        raise CommandError(f"--timeout must be above 0, got {args.timeout:g}")
    return {
        "timeout": args.timeout,
        "adapter": args.adapter or None,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }


def _print_stream(deltas) -> str:
    text, last = [], None
    for delta in deltas:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        text.append(delta.text)
        last = delta
    sys.stdout.write("\n")
    if last is not None and last.usage is not None:
        u = last.usage
        print(
            f"[{last.finish_reason}] {u.prompt_tokens} prompt + {u.completion_tokens} generated tokens, "
            f"first token {u.first_token_ms:.0f} ms, total {u.total_ms:.0f} ms",
            file=sys.stderr,
        )
    return "".join(text)


def cmd_generate(args) -> int:
    with gateway_client(args) as client:
        _print_stream(client.stream(args.prompt, **_options(args)))
    return 0


def cmd_chat(args) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with gateway_client(args) as client:
        if args.message is not None:
            messages.append({"role": "user", "content": args.message})
            _print_stream(client.chat_stream(messages, **_options(args)))
            return 0
        print("chat: type a message, empty line or Ctrl-D to end", file=sys.stderr)
        for line in sys.stdin:
            if not line.strip():
                break
            messages.append({"role": "user", "content": line.rstrip("\n")})
            reply = _print_stream(client.chat_stream(messages, **_options(args)))
            messages.append({"role": "assistant", "content": reply})
    return 0
