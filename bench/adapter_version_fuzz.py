"""Publishes of one adapter name while requests stream on it: no answer from a version older than
the newest published before the request was sent, and each answer the one its version gives.

    .venv/bin/python -m bench.adapter_version_fuzz [--publishes 10000] [--streams 3] [--contents 3]

A publisher publishes ``--contents`` PEFT adapters in turn under one name through the SDK
(``client.adapters.publish``; with the store's default ``--keep-versions`` 4 and 3 contents,
every publish after the first three is a rollback to a kept version's content); meanwhile
``--streams`` loops ask for greedy completions naming the plain name. For every answer:

- **stale**: the version that served it (``served_by``) is older than the newest version whose
  publish had returned before the request was sent;
- **mislabelled**: its ``served_by`` sha256 is not the one that version was published with;
- **inconsistent**: its tokens differ from another answer of the same content (greedy decoding
  of one prompt: one answer per content; a test checks each content's answer against
  transformers + peft).

The mesh (``loramesh up --workers 2``: float32, prefix cache on, the dlora batch policy, which
serves an adapter merged into the base weights when it has the batch to itself) runs for the
whole campaign. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from bench.side_by_side import local_mesh
from loramesh.async_client import AsyncClient
from services.model_files.base_model import load_base_model_spec

PROMPT = "Write one sentence about the sea."
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
WORKER_FLAGS = ("--batch-policy", "dlora", "--prefix-cache", "on")
"""What the campaign's workers run beyond up's defaults: merged mode allowed, prefix cache on."""


@dataclass(frozen=True)
class Answer:
    floor: int
    """The newest version whose publish had returned when the request was sent."""
    version: int
    sha256: str
    token_ids: tuple[int, ...]
    text: str


@dataclass
class FuzzReport:
    publishes: int = 0
    answers: list[Answer] = field(default_factory=list)
    published: dict[int, str] = field(default_factory=dict)
    """The sha256 each version was published with."""

    def stale(self) -> list[Answer]:
        return [a for a in self.answers if a.version < a.floor]

    def mislabelled(self) -> list[Answer]:
        return [a for a in self.answers if self.published.get(a.version, a.sha256) != a.sha256]

    def by_content(self) -> dict[str, set[tuple[int, ...]]]:
        """Each content's distinct answers (one each when nothing is inconsistent)."""
        answers: dict[str, set[tuple[int, ...]]] = {}
        for answer in self.answers:
            answers.setdefault(answer.sha256, set()).add(answer.token_ids)
        return answers

    def summary(self) -> dict:
        by_content = self.by_content()
        return {
            "publishes": self.publishes,
            "answers": len(self.answers),
            "versions_served": len({a.version for a in self.answers}),
            "stale": len(self.stale()),
            "mislabelled": len(self.mislabelled()),
            "inconsistent_contents": sum(1 for answers in by_content.values() if len(answers) > 1),
            "contents_served": len(by_content),
        }


async def fuzz(
    client: AsyncClient, name: str, contents: list[Path], publishes: int, streams: int, paced: bool = False
) -> FuzzReport:
    """Publish ``contents`` in turn ``publishes`` times under ``name`` while ``streams`` loops ask
    for completions naming it; ``paced``: each publish waits for an answer to a request sent
    after it returned (so every version serves, however slow the answers)."""
    report = FuzzReport()
    newest = [0]
    done = asyncio.Event()
    answered = asyncio.Event()

    async def publisher() -> None:
        try:
            for i in range(publishes):
                published = await client.adapters.publish(contents[i % len(contents)], name)
                report.published[published.version] = published.sha256
                newest[0] = max(newest[0], published.version)
                report.publishes += 1
                while paced and not any(a.floor >= published.version for a in report.answers[-streams:]):
                    await answered.wait()
                    answered.clear()
        finally:
            done.set()

    async def asker() -> None:
        while not done.is_set():
            floor = newest[0]
            if not floor:
                await asyncio.sleep(0.01)  # nothing published yet
                continue
            completion = await client.generate(PROMPT, adapter=name, **GREEDY)
            served = completion.served_by
            report.answers.append(
                Answer(floor, served.version, served.sha256, tuple(completion.token_ids), completion.text)
            )
            answered.set()

    await asyncio.gather(publisher(), *(asker() for _ in range(streams)))
    return report


def write_contents(root: Path, count: int) -> list[Path]:
    spec = load_base_model_spec()
    return [
        write_peft_adapter(root / f"c{seed}", spec, SampleAdapterSpec(rank=8, scale=0.04, seed=seed))
        for seed in range(31, 31 + count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--publishes", type=int, default=10_000)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--contents", type=int, default=3)
    parser.add_argument("--paced", action="store_true", help="each publish waits for an answer after it")
    args = parser.parse_args()
    contents = write_contents(Path(tempfile.mkdtemp(prefix="lm-fuzz-")), args.contents)
    load_before = os.getloadavg()
    with local_mesh(workers=2, flags=WORKER_FLAGS) as mesh:

        async def run() -> tuple[FuzzReport, float]:
            async with AsyncClient(mesh.services["gateway"].address, mesh.admin_api_key) as client:
                started = time.perf_counter()
                report = await fuzz(client, "policy", contents, args.publishes, args.streams, args.paced)
                return report, time.perf_counter() - started

        report, elapsed = asyncio.run(run())
    print(
        json.dumps(
            {
                **report.summary(),
                "seconds": round(elapsed, 1),
                "load_before": [round(v, 2) for v in load_before],
                "load_after": [round(v, 2) for v in os.getloadavg()],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
