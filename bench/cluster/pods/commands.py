"""Running the host's network tools (ip, nft) with failures that say what failed."""

from __future__ import annotations

import subprocess


class CommandFailed(RuntimeError):
    pass


def run(*argv: str, stdin: str | None = None, check: bool = True) -> str:
    """Run ``argv``; its stdout. A failure raises :class:`CommandFailed` naming the command and
    its stderr (``check=False``: returns the stdout anyway, for teardown)."""
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise CommandFailed(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def in_netns(netns: str, *argv: str, stdin: str | None = None, check: bool = True) -> str:
    """``argv`` run in network namespace ``netns`` (``ip netns exec``)."""
    return run("ip", "netns", "exec", netns, *argv, stdin=stdin, check=check)
