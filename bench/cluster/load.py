"""The nemesis's load: clients of the mesh streaming generations, borrowing ones (prompts longer
than a worker's KV pool: their KV overflows to a creditor), uploading, fetching and listing
adapters through the gateways, every operation recorded in a :class:`~bench.cluster.history.History`.

Run inside a client pod's network namespace (``ip netns exec``), so its traffic is the run's:
``python -m bench.cluster.load --gateways IP:PORT,... --api-key KEY --tls CA CERT KEY --out DIR
--seed N [--deterministic]``. ``DIR/running`` appears once its first operation is invoked (the
runner starts the fault schedule's clock then). It runs until ``DIR/stop`` exists, lets the operations in flight
finish (each within its deadline: a stream that hits it is recorded as timed out), observes the
store (every name listed and fetched once more, after the faults) and writes ``history.jsonl``,
``store.json`` and ``references.json`` to ``DIR``. The history's clock is ``time.monotonic``, the
machine's: the runner's observations are on the same clock.

Streams are greedy. Under ``--deterministic`` (workers with batch-invariant numerics) each is
judged token for token against its prompt's undisturbed run, taken before the load starts;
otherwise it is judged well-formed only (``Sampling.SAMPLED``): a client does not see where the
gateway continued a stream on another worker, past which a greedy stream may differ.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.cluster.history import History, OpKind, Outcome, Sampling, StreamRecord
from bench.cluster.observations import StoreObservation
from bench.sample_adapters import SampleAdapterSpec, write_peft_adapter
from loramesh import AsyncClient
from loramesh.errors import DeadlineExceeded, LoraMeshError, Unavailable
from loramesh.tls import ClientTLS
from services.model_files.base_model import load_base_model_spec

MESH_SERVER_NAME = "mesh.loramesh"
"""What every mesh certificate names (the gateways are dialled by address)."""
WEIGHTS = "adapter_model.safetensors"
SHORT_PROMPTS = (
    "Write one sentence about rivers.",
    "Name three colours of the sea.",
    "What is a lighthouse for?",
    "Describe a mountain in five words.",
)


def long_prompt(index: int, lines: int) -> str:
    """A prompt of about 13 tokens a line, each of ``index``'s own (no shared prefix to cache)."""
    return " ".join(f"Line {index}.{i}: the quick brown fox jumps over the lazy dog." for i in range(lines))


@dataclass(frozen=True)
class LoadConfig:
    """One run of the load."""

    gateways: tuple[str, ...]
    """``ip:port`` of every gateway pod's gRPC port (the SDK fails over between them)."""
    api_key: str
    tls: tuple[str, str, str]
    """CA, certificate and key of the caller."""
    out: Path
    """Where the results go; ``out/stop`` ends the run."""
    seed: int = 0
    """Chooses the prompts, the adapters' weights and the operations' order."""
    streamers: int = 2
    """Clients streaming short generations, one at a time each."""
    borrowers: int = 1
    """Clients streaming long prompts whose KV overflows a worker's pool."""
    uploaders: int = 1
    """Clients uploading adapters, fetching and listing them."""
    upload_pause_s: float = 2.0
    """Pause between an uploader's rounds (upload, two fetches, a listing): paced, so that the
    store's traffic leaves the generations the CPU (unpaced, 500 uploads a minute starve them)."""
    max_tokens: int = 12
    long_prompt_lines: int = 40
    """A long prompt's lines (~13 tokens each): ~520 tokens, more than one 400-token pool holds."""
    long_prompts: int = 3
    deterministic: bool = False
    """The workers serve batch-invariant numerics: streams must equal their undisturbed run."""
    stream_deadline_s: float = 180.0
    """Each stream's gRPC deadline, its retries included: a stream that hits it is recorded as
    timed out (``info``: the client gave up; whether the mesh would have finished it is unknown),
    so the load ends at most this long after its stop however a stream is stuck. Far beyond any
    stream's own time here (seconds; a minute behind a restarting worker): a hang guard."""
    call_timeout_s: float = 180.0
    """The same bound on each other call (uploads, fetches, listings), its retries included."""
    retries: int = 30
    """The SDK's retries of an UNAVAILABLE call (each on the next gateway): a fault lasts up to
    tens of seconds, longer than the SDK's default six retries."""


class Load:
    """The clients of one run."""

    def __init__(self, config: LoadConfig, history: History):
        self.config, self.history = config, history
        self.rng = random.Random(config.seed)
        self.acknowledged: list[str] = []
        self.uploaded: list[str] = []
        self.references: dict[str, list[int]] = {}
        self._stop = asyncio.Event()
        self._work = Path(tempfile.mkdtemp(prefix="nemesis-adapters-"))
        self._spec = load_base_model_spec()
        self._current: dict[str, StreamRecord] = {}

    def client(self, process: str) -> AsyncClient:
        def resumed(_notice) -> None:
            if process in self._current:
                self._current[process].resumed()

        tls = ClientTLS(*self.config.tls, server_name=MESH_SERVER_NAME)
        return AsyncClient(
            list(self.config.gateways), self.config.api_key, tls=tls, timeout=self.config.call_timeout_s,
            retries=self.config.retries, on_retry=resumed,
        )  # fmt: skip

    def prompts(self) -> dict[str, tuple[OpKind, str]]:
        short = {f"short-{i}": (OpKind.GENERATE_STREAM, p) for i, p in enumerate(SHORT_PROMPTS)}
        long = {
            f"long-{i}": (OpKind.BORROW, long_prompt(i, self.config.long_prompt_lines))
            for i in range(self.config.long_prompts)
        }
        return {**short, **long}

    async def run(self, stop_file: Path, running_file: Path) -> None:
        """The clients until ``stop_file`` exists; ``running_file`` is made once the first
        operation was invoked."""
        if self.config.deterministic:
            await self.take_references()
        clients = (
            [self.streamer(f"stream-{i}") for i in range(self.config.streamers)]
            + [self.streamer(f"borrow-{i}", borrowing=True) for i in range(self.config.borrowers)]
            + [self.uploader(f"upload-{i}") for i in range(self.config.uploaders)]
        )
        tasks = [asyncio.create_task(c) for c in clients]
        while not stop_file.exists():
            if len(self.history) and not running_file.exists():
                running_file.touch()
            await asyncio.sleep(0.2)
        self._stop.set()
        await asyncio.gather(*tasks)

    async def take_references(self) -> None:
        """Each prompt's undisturbed run, before any fault."""
        async with self.client("reference") as client:
            for key, (_, prompt) in self.prompts().items():
                tokens: list[int] = []
                async for delta in client.stream(prompt, max_tokens=self.config.max_tokens, temperature=0.0,
                                                 ignore_eos=True, timeout=self.config.stream_deadline_s):  # fmt: skip
                    tokens += delta.token_ids
                self.references[key] = tokens

    async def streamer(self, process: str, borrowing: bool = False) -> None:
        prompts = [(k, v) for k, v in self.prompts().items() if (v[0] == OpKind.BORROW) == borrowing]
        sampling = Sampling.DETERMINISTIC if self.config.deterministic else Sampling.SAMPLED
        async with self.client(process) as client:
            while not self._stop.is_set():
                key, (kind, prompt) = self.rng.choice(prompts)
                # The first two adapters only: every adapter streamed stays resident in the
                # worker's pool while idle, and idle adapters' pages are not lent (see
                # bench/HISTORY.md, "What the first rounds found").
                adapter = self.rng.choice([None, *self.acknowledged[:2]]) if not borrowing else None
                if adapter is not None:
                    key = f"{key}@{adapter}"
                    sampling_now = Sampling.SAMPLED  # no reference taken with this adapter
                else:
                    sampling_now = sampling
                op = self.history.invoke(process, kind, key, sampling=sampling_now)
                record = self._current[process] = StreamRecord()
                try:
                    async for delta in client.stream(prompt, adapter=adapter, max_tokens=self.config.max_tokens,
                                                     temperature=0.0, ignore_eos=True,
                                                     timeout=self.config.stream_deadline_s):  # fmt: skip
                        record.received(delta.token_ids, self.history.clock())
                        record.finish_reason = delta.finish_reason or record.finish_reason
                    self.history.complete(op, Outcome.OK, **record.payload())
                except DeadlineExceeded as error:  # its deadline passed: a timeout, not a failure
                    self.history.complete(op, Outcome.INFO, error=_error(error), **record.payload())
                except LoraMeshError as error:
                    self.history.complete(op, Outcome.FAIL, error=_error(error), **record.payload())
                finally:
                    del self._current[process]

    async def uploader(self, process: str) -> None:
        async with self.client(process) as client:
            n = 0
            while not self._stop.is_set():
                await self.upload(client, process, f"nem-{self.config.seed}-{n}", n)
                n += 1
                for _ in range(2):
                    if self.acknowledged:
                        await self.fetch(client, process, self.rng.choice(self.acknowledged))
                await self.list(client, process)
                try:
                    await asyncio.wait_for(self._stop.wait(), self.config.upload_pause_s)
                except TimeoutError:
                    pass

    async def upload(self, client: AsyncClient, process: str, name: str, n: int) -> None:
        directory = write_peft_adapter(
            self._work / name, self._spec,
            SampleAdapterSpec(rank=2, target_modules=("q_proj", "v_proj"), scale=0.05, seed=self.config.seed * 1000 + n),
        )  # fmt: skip
        digest = hashlib.sha256((directory / WEIGHTS).read_bytes()).hexdigest()
        op = self.history.invoke(process, OpKind.UPLOAD, name, digest=digest)
        self.uploaded.append(name)
        try:
            await client.adapters.upload(directory, name)
            self.history.complete(op, Outcome.OK)
            self.acknowledged.append(name)
        except (Unavailable, DeadlineExceeded) as error:  # the reply may have been lost after the commit
            self.history.complete(op, Outcome.INFO, error=_error(error))
        except LoraMeshError as error:
            self.history.complete(op, Outcome.FAIL, error=_error(error))

    async def fetch(self, client: AsyncClient, process: str, name: str) -> None:
        op = self.history.invoke(process, OpKind.FETCH, name)
        try:
            adapter = await client.adapters.get(name)
            self.history.complete(op, Outcome.OK, digest=adapter.sha256)
        except LoraMeshError as error:
            self.history.complete(op, Outcome.FAIL, error=_error(error))

    async def list(self, client: AsyncClient, process: str) -> None:
        op = self.history.invoke(process, OpKind.LIST, f"nem-{self.config.seed}-")
        try:
            names = tuple(a.name for a in await client.adapters.list())
            self.history.complete(op, Outcome.OK, names=names)
        except LoraMeshError as error:
            self.history.complete(op, Outcome.FAIL, error=_error(error))

    async def observe_store(self) -> StoreObservation:
        """Every name listed, and each name uploaded fetched, once the faults are healed."""
        async with self.client("final") as client:
            listed = frozenset(a.name for a in await client.adapters.list())
            digests, errors = {}, {}
            for name in self.uploaded:
                try:
                    digests[name] = (await client.adapters.get(name)).sha256
                except LoraMeshError as error:
                    errors[name] = _error(error)
        return StoreObservation(listed, digests, errors)


def _error(error: LoraMeshError) -> str:
    return f"{error.code}: {error}"


def write_store(observation: StoreObservation, path: Path) -> None:
    record = asdict(observation)
    record["listed"] = sorted(observation.listed)
    path.write_text(json.dumps(record))


def read_store(path: Path) -> StoreObservation:
    record = json.loads(path.read_text())
    return StoreObservation(frozenset(record["listed"]), record["digests"], record["fetch_errors"])


async def main_async(config: LoadConfig) -> None:
    history = History()
    load = Load(config, history)
    try:
        await load.run(config.out / "stop", config.out / "running")
        write_store(await load.observe_store(), config.out / "store.json")
    finally:
        history.write_jsonl(config.out / "history.jsonl")
        (config.out / "references.json").write_text(json.dumps(load.references))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster.load")
    parser.add_argument("--gateways", required=True, help="ip:port,... of the gateway pods")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--tls", nargs=3, metavar=("CA", "CERT", "KEY"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args(argv)
    config = LoadConfig(tuple(args.gateways.split(",")), args.api_key, tuple(args.tls), args.out, args.seed,
                        deterministic=args.deterministic)  # fmt: skip
    asyncio.run(main_async(config))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
