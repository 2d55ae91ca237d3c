"""The user docs (README.md, docs/*.md) read as a product's, and the defaults they state are the code's.

No former values beside current ones (``15 s (was 5)``): a diary's trace.

No internal issue numbers. The rule: ``issue 48``, ``issues 48 and 49``, ``issue-48`` and
``#48`` are forbidden, in any case. A ``#N`` is allowed only right after the name of an upstream
project whose tracker it points to (``vLLM #12345``, ``SGLang #678``): the project's own issues are
development history (bench/HISTORY.md), not documentation. ``#`` followed by a letter (a URL
fragment, a Markdown heading, an HTML entity) is not a number and is allowed.

Documented defaults: every ``| flag | default | meaning |`` table of docs/operations.md, the
service flags, names flags of the service config its section is about (the settings every
service has, then the adapter store, gpu_worker, scheduler and gateway). A row whose flag the
config does not have fails, and a row whose default is a number or a word must equal the
config's default (``on``/``off`` for a switch, ``empty``/``none`` for an empty value). A row that
describes its default in words (``(required)``, ``SmolLM2-135M GGUF``, ``on in the adapter store
and the gateway, off elsewhere``) is not compared. docs/sdk.md's ``| argument | default | meaning |``
table is held to ``Client``'s and ``AsyncClient``'s signatures the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import loramesh
from services.adapter_store.config import AdapterStoreConfig
from services.gateway.config import GatewayConfig
from services.gpu_worker.config import WorkerConfig
from services.runtime.config import ServiceConfig
from services.scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

UPSTREAM = (
    "vLLM",
    "SGLang",
    "LoRAX",
    "llama.cpp",
    "PEFT",
    "peft",
    "transformers",
    "Triton",
    "torch",
    "PyTorch",
)
ISSUE_WORD = re.compile(r"\bissues?[ -]#?\d+", re.IGNORECASE)
HASH_NUMBER = re.compile(r"(?<![\w&/])#\d+\b")
UPSTREAM_BEFORE = re.compile(
    r"\b(?:" + "|".join(re.escape(name) for name in UPSTREAM) + r")(?:'s)?\s+(?:PR\s+|issue\s+)?$"
)


def issue_numbers(text: str) -> list[str]:
    """Every internal issue reference in ``text``, as it is written (see the module's rule)."""
    found = [match.group(0) for match in ISSUE_WORD.finditer(text)]
    for match in HASH_NUMBER.finditer(text):
        line_start = text.rfind("\n", 0, match.start()) + 1
        if not UPSTREAM_BEFORE.search(text[line_start : match.start()]):
            found.append(match.group(0))
    return found


def test_the_rule_allows_upstream_numbers_and_refuses_ours() -> None:
    assert issue_numbers("fixed in vLLM #48312 and SGLang #12") == []
    assert issue_numbers("see [docs](api.md#cli), &#39; and # 48 in a heading") == []
    assert OLD_VALUE.findall("lease TTL 15 s (was 5), a window (was 6.7 s)") == ["(was 5)", "(was 6.7 s)"]
    assert not OLD_VALUE.findall("(was it refused?)")
    assert issue_numbers("done for issue 48, issues 49 and 50, issue-16's calibration, see #51") == [
        "issue 48",
        "issues 49",
        "issue-16",
        "#51",
    ]


OLD_VALUE = re.compile(r"\((?:was|were) [^)]*\d[^)]*\)")
"""A diary's trace beside a value: ``15 s (was 5)``. The docs state what is, the history is in
bench/HISTORY.md and git."""


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda path: path.name)
def test_user_docs_state_no_former_values(doc: Path) -> None:
    lines = doc.read_text(encoding="utf-8").splitlines()
    found = [
        f"{doc.name}:{number}: {hit}"
        for number, line in enumerate(lines, 1)
        for hit in OLD_VALUE.findall(line)
    ]
    assert not found, "former values in the user docs:\n" + "\n".join(found)


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda path: path.name)
def test_user_docs_carry_no_issue_numbers(doc: Path) -> None:
    lines = doc.read_text(encoding="utf-8").splitlines()
    found = [
        f"{doc.name}:{number}: {hit}" for number, line in enumerate(lines, 1) for hit in issue_numbers(line)
    ]
    assert not found, "internal issue numbers in the user docs:\n" + "\n".join(found)


OPERATIONS = ROOT / "docs" / "operations.md"
TABLE_HEADER = "| flag | default | meaning |"
SECTIONS: list[tuple[str, str, type[ServiceConfig]]] = [
    # (the last "## " heading above the table, a text in the paragraph just above it, the config)
    ("## Running one service", "Settings every service has", ServiceConfig),
    ("## Running one service", "Adapter store:", AdapterStoreConfig),
    ("## Running one service", "gpu_worker (", WorkerConfig),
    ("## Scheduler", "", SchedulerConfig),
    ("## Gateway", "", GatewayConfig),
]
NUMBER = re.compile(r"^[−-]?\d+(?:\.\d+)?(?=$|\s)")
WORD = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_./-]*$")


@dataclasses.dataclass
class FlagRow:
    """One row of a service flag table."""

    config: type[ServiceConfig]
    """The service config the row's section is about."""
    line: int
    """The row's line in docs/operations.md (1-based), for the failure message."""
    flags: list[str]
    """The flags its first cell names (``--api-keys-file`` / ``--api-keys``)."""
    default: str
    """Its default cell, as written."""


def flag_tables() -> list[FlagRow]:
    """Every row of docs/operations.md's service flag tables, with the config its section is about."""
    lines = OPERATIONS.read_text(encoding="utf-8").splitlines()
    rows: list[FlagRow] = []
    heading = ""
    for index, line in enumerate(lines):
        if line.startswith("## "):
            heading = line
        if line.strip() != TABLE_HEADER:
            continue
        above = "\n".join(lines[max(0, index - 8) : index])
        paragraph = above.rsplit("\n\n", 1)[-1]
        configs = [cls for head, marker, cls in SECTIONS if heading.startswith(head) and marker in paragraph]
        assert len(configs) == 1, (
            f"operations.md:{index + 1}: which config a flag table under {heading!r} is about"
        )
        config = configs[0]
        for number, row in enumerate(lines[index + 2 :], index + 3):
            if not row.startswith("|"):
                break
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
            rows.append(FlagRow(config, number, re.findall(r"`(--[a-z0-9-]+)", cells[0]), cells[1]))
    return rows


def documented_value(cell: str) -> str | None:
    """The default a row states when it is a number or a single word (an address and a path are
    words); None when it is prose."""
    text = re.sub(r"\s*\([^)]*\)\s*$", "", cell.replace("`", "")).strip()
    if match := NUMBER.match(text):
        return match.group(0).replace("−", "-")
    return text if WORD.match(text) else None


def code_value(default: object) -> set[str]:
    """How the doc may write a default that is not a number."""
    if isinstance(default, bool):
        return {"on", "true"} if default else {"off", "false"}
    if default in ("", None):
        return {"empty", "none"}
    return {str(default)}


def agrees(stated: str, default: object) -> bool:
    """Whether the doc's ``stated`` default is the code's ``default`` (``60.0`` and ``60`` alike)."""
    if isinstance(default, (int, float)) and not isinstance(default, bool) and NUMBER.match(stated):
        return float(stated) == default
    return stated in code_value(default)


def test_a_stated_default_is_read_as_the_doc_writes_it() -> None:
    assert documented_value("`−1`") == "-1"
    assert documented_value("1048576 (1 MiB)") == "1048576"
    assert documented_value("empty (the `--host`)") == "empty"
    assert documented_value("`least-estimated-wait`") == "least-estimated-wait"
    assert documented_value("on in the adapter store and the gateway, off elsewhere") is None
    assert code_value(False) == {"off", "false"} and code_value("") == {"empty", "none"}
    assert agrees("60.0", 60.0) and agrees("-1", -1) and not agrees("0", -1)


def test_every_flag_table_is_read() -> None:
    configs = {row.config for row in flag_tables()}
    assert configs == {cls for _, _, cls in SECTIONS}


@pytest.mark.parametrize("row", flag_tables(), ids=lambda row: f"{row.config.__name__}:{'/'.join(row.flags)}")
def test_documented_defaults_equal_the_code(row: FlagRow) -> None:
    fields = {field.name: field for field in dataclasses.fields(row.config)}
    for flag in row.flags:
        name = flag.removeprefix("--").replace("-", "_")
        assert name in fields, f"operations.md:{row.line}: {flag} is not a setting of {row.config.__name__}"
        stated = documented_value(row.default)
        field = fields[name]
        if stated is None or field.default is dataclasses.MISSING:
            continue
        assert agrees(stated, field.default), (
            f"operations.md:{row.line}: {flag} is documented with default {row.default!r}, "
            f"but {row.config.__name__}.{name} defaults to {field.default!r}"
        )


SDK = ROOT / "docs" / "sdk.md"


def sdk_argument_rows() -> list[tuple[int, str, str]]:
    """``(line, argument, default cell)`` of docs/sdk.md's ``| argument | default | meaning |`` table."""
    lines = SDK.read_text(encoding="utf-8").splitlines()
    start = lines.index("| argument | default | meaning |")
    rows = []
    for number, row in enumerate(lines[start + 2 :], start + 3):
        if not row.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
        rows.append((number, cells[0].strip("`"), cells[1]))
    return rows


@pytest.mark.parametrize("client", ["Client", "AsyncClient"])
def test_sdk_documented_defaults_equal_the_client(client: str) -> None:
    parameters = inspect.signature(getattr(loramesh, client).__init__).parameters
    for line, argument, cell in sdk_argument_rows():
        assert argument in parameters, f"sdk.md:{line}: {client} has no argument {argument!r}"
        stated = documented_value(cell)
        default = parameters[argument].default
        if stated is not None and stated not in ("none", "empty") and isinstance(default, (int, float, str)):
            assert agrees(stated, default), (
                f"sdk.md:{line}: {argument} is documented with default {cell!r}, "
                f"but {client} defaults to {default!r}"
            )
