"""Fuzzing every HTTP route of the gateway: the OpenAI port (every route of its app, read from the
OpenAPI document it serves at ``/openapi.json``) and the HTTP side port.

The system under test is the gateway's input handling, on a real gateway service (its uvicorn
port, its core, a real adapter store) in front of a fake worker that cannot fail
(tests/support/fuzz_gateway.py). Three runs, each derandomized with a fixed example budget:

- schemathesis, from the served document: for every operation, bodies, path parameters and
  headers that fit the routes' pydantic models (positive) and that break them (negative), with
  alice's API key or a wrong one, and model names that exist, are someone else's, or are not;
- hypothesis, one field of a valid body at a time replaced by an adversarial value (the field
  paths read from the routes' models): huge and negative numbers, NaN and infinities, long and
  odd unicode (lone surrogates, NULs, right-to-left marks), huge arrays, deep nesting; and whole
  bodies that are not JSON, nest past the parser's limit, or come with the wrong content type;
- raw bytes on the side port.

Every answer must be below 500 (the worker, scheduler and store are up: nothing here may be
503), within :data:`CALL_TIMEOUT_S`, and must not contain bob's private adapter (its name or
id) unless the request named it. Afterwards the gateway still serves a valid request. The counts
are printed at the end of each test (past pytest's capture) and quoted in docs/security.md,
"Fuzzing".
"""

from __future__ import annotations

import copy
import json
import socket
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from support.cli import COMMAND_TIMEOUT_S
from support.fuzz_gateway import ALICE_KEY, ALICE_OWN, BOB_PRIVATE, BOB_PUBLIC, FUZZ, FuzzGateway, Tally

from services.gateway.http.app import build_app
from services.gateway.http.openapi import NO_BODY, REQUEST_BODIES, openapi_document, operations

CALL_TIMEOUT_S = COMMAND_TIMEOUT_S
"""Not a timing claim: turns a hung request into a named failure."""
BASE = "SmolLM2-135M-Instruct"
SCHEMA_EXAMPLES = 25
"""Examples per operation and generation mode (positive, negative) from the OpenAPI document."""
MUTATION_EXAMPLES = 40
"""Adversarial bodies per operation."""
SIDE_PORT_EXAMPLES = 40

MODELS = st.sampled_from(
    [BASE, ALICE_OWN, f"alice/{ALICE_OWN}", f"bob/{BOB_PUBLIC}", f"bob/{BOB_PRIVATE}", BOB_PRIVATE, "", "nope",
     "../../etc/passwd", "bob/", "/", "a" * 300]
)  # fmt: skip
"""Model names: the base model, alice's own, bob's public and private ones, and nonsense."""
OTHER_KEYS = [None, "", "Bearer ", "Bearer wrong", "Basic a2V5", f"bearer {ALICE_KEY}", f"Bearer {ALICE_KEY} x",
              "Bearer \u00e9"]  # fmt: skip
KEYS = st.one_of(st.just(f"Bearer {ALICE_KEY}"), st.sampled_from(OTHER_KEYS))
"""``Authorization`` headers: alice's key half the time (to get past it), never bob's."""

VALID_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/v1/completions"): {"model": BASE, "prompt": "Hello", "max_tokens": 3},
    ("POST", "/v1/chat/completions"): {
        "model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
    },
    ("POST", "/v1/load_lora_adapter"): {"lora_name": "fuzzed", "lora_path": "fuzzed"},
    ("POST", "/v1/unload_lora_adapter"): {"lora_name": "no-such-adapter"},
    ("POST", "/tokenize"): {"model": BASE, "prompt": "Hello"},
    ("POST", "/detokenize"): {"model": BASE, "tokens": [1, 2, 3]},
    ("POST", "/"): {"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
    ("POST", "/generate"): {"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
    ("POST", "/generate_stream"): {"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
}  # fmt: skip
"""A body each POST route serves: the adversarial run changes one field of it at a time."""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, base_spec):
    with FuzzGateway.with_sample_adapter(tmp_path_factory.mktemp("fuzz-http"), base_spec) as running:
        yield running


@pytest.fixture(scope="module")
def document(gateway) -> dict:
    reply = requests.get(f"{gateway.http}/openapi.json", timeout=CALL_TIMEOUT_S)
    assert reply.status_code == 200
    return reply.json()


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


def assert_clear(gateway: FuzzGateway, target: str, status: int, body: bytes, asked: str) -> None:
    assert status < 500, f"{target}: {status} {body[:500]!r}\nasked: {asked[:2000]}"
    leaked = gateway.leaked(body, asked)
    assert not leaked, f"{target}: another tenant's {leaked} in {body[:500]!r}\nasked: {asked[:2000]}"


def still_serves(gateway: FuzzGateway) -> None:
    reply = requests.post(
        f"{gateway.http}/v1/chat/completions",
        json={"model": ALICE_OWN, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        headers={"authorization": f"Bearer {ALICE_KEY}"},
        timeout=CALL_TIMEOUT_S,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "length"


def app_operations(gateway: FuzzGateway) -> list[tuple[str, str]]:
    """``(method, path)`` of every route of the gateway's app on the OpenAI port."""
    return operations(build_app(gateway.gateway_service.parts, gateway.gateway_service.metrics).routes)


# -- the document ----------------------------------------------------------------------------


def test_the_document_lists_every_route_with_its_body(gateway, document):
    """Every route of the app is in the served document (so every route is fuzzed below), and
    every POST route that reads a body has the schema of the model it parses and a valid body
    for the adversarial run."""
    app = build_app(gateway.gateway_service.parts, gateway.gateway_service.metrics)
    assert document == json.loads(json.dumps(openapi_document(app.routes)))
    listed = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    routes = {(method, path.replace("{model:path}", "{model}")) for method, path in operations(app.routes)}
    assert listed == routes
    posts = {(m, p) for m, p in operations(app.routes) if m == "POST"}
    assert posts == set(REQUEST_BODIES) | NO_BODY, "a POST route without a body model in openapi.py"
    assert set(VALID_BODIES) == set(REQUEST_BODIES), "a POST route without a valid body to fuzz from"
    for method, path in REQUEST_BODIES:
        operation = document["paths"][path][method.lower()]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]


# -- schemathesis, from the served document ----------------------------------------------------


def _with_names(case, data) -> None:
    """Point some cases at real models, so they get past the model lookup."""
    if isinstance(case.body, dict) and data.draw(st.booleans(), label="real model"):
        if "inputs" in case.body:
            if not isinstance(case.body.get("parameters"), dict):
                case.body["parameters"] = {}
            case.body["parameters"]["adapter_id"] = data.draw(MODELS, label="adapter_id")
        else:
            case.body["model"] = data.draw(MODELS, label="model")
    if case.path_parameters and "model" in case.path_parameters and data.draw(st.booleans()):
        case.path_parameters["model"] = data.draw(MODELS, label="path model")


def fuzz_operation(gateway: FuzzGateway, session, tally: Tally, operation, mode: GenerationMode) -> None:
    """schemathesis' cases of ``mode`` for one operation of the document."""
    target = f"{operation.label} [{mode.value}]"

    @settings(FUZZ, max_examples=SCHEMA_EXAMPLES)
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def fuzz(case, data):
        _with_names(case, data)
        key = data.draw(KEYS, label="authorization")
        case.headers = dict(case.headers or {})
        case.headers.pop("Authorization", None)
        if key is not None:
            case.headers["Authorization"] = key
        try:
            reply = case.call(base_url=gateway.http, session=session, timeout=CALL_TIMEOUT_S)
        except requests.ConnectionError:  # a kept-alive connection the server had closed: once more
            reply = case.call(base_url=gateway.http, timeout=CALL_TIMEOUT_S)
        sent = reply.request
        body = sent.body if isinstance(sent.body, bytes) else str(sent.body or "").encode()
        asked = f"{sent.method} {sent.url} {sent.headers} " + body.decode("utf-8", "replace")
        tally.add(target, reply.status_code)
        assert_clear(gateway, target, reply.status_code, reply.content, asked)

    fuzz()


#: Operations with no body and no parameter: nothing for a negative case to break.
NOTHING_TO_BREAK = {"/health", "/ping", "/version", "/metrics", "/openapi.json"}


def test_every_operation_of_the_openapi_document(request, gateway, document, session):
    schema = schemathesis.openapi.from_dict(document)
    tally = Tally("HTTP, schemathesis (positive and negative cases from /openapi.json)")
    operations_run = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations_run += 1
        fuzz_operation(gateway, session, tally, operation, GenerationMode.POSITIVE)
        if operation.path not in NOTHING_TO_BREAK:
            fuzz_operation(gateway, session, tally, operation, GenerationMode.NEGATIVE)
    assert operations_run == sum(len(ops) for ops in document["paths"].values())
    still_serves(gateway)
    tally.report(request.config)


# -- adversarial values, one field of a valid body at a time ---------------------------------


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        schema = root["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def field_paths(schema: dict, root: dict, prefix: tuple = (), depth: int = 3) -> list[tuple]:
    """Every field path of a body schema (into objects and the first item of arrays), to
    ``depth`` levels: where the adversarial run puts its values."""
    schema = _resolve(schema, root)
    paths = []
    options = schema.get("anyOf", [schema])
    for option in options:
        option = _resolve(option, root)
        if depth and option.get("type") == "object":
            for name, sub in option.get("properties", {}).items():
                paths.append((*prefix, name))
                paths += field_paths(sub, root, (*prefix, name), depth - 1)
        if depth and option.get("type") == "array" and "items" in option:
            paths += field_paths(option["items"], root, (*prefix, 0), depth - 1)
    return sorted(set(paths), key=str)


def put(body: Any, path: tuple, value: Any) -> Any:
    """``body`` with ``value`` at ``path``, making the containers on the way."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        items = list(body) if isinstance(body, list) else []
        items = items or [{}]
        items[0] = put(items[0], rest, value)
        return items
    mapping = dict(body) if isinstance(body, dict) else {}
    mapping[head] = put(mapping.get(head), rest, value)
    return mapping


def nested(depth: int, leaf: Any = 1, kind: str = "[") -> Any:
    value = leaf
    for _ in range(depth):
        value = [value] if kind == "[" else {"a": value}
    return value


ODD_TEXT = st.sampled_from(
    ["", "\x00", "\ud800", "\udfff\ud800", "\u202e\u2066abc", "🦜" * 1000, "a" * 70_000, "\n" * 5000,
     "{{ 7*7 }}", "{% for x in range(10**9) %}{% endfor %}", "<|im_end|>", "</s>", "%s%n%x", "\\u0000",
     "bob/" + BOB_PRIVATE, "' OR 1=1 --", "a" * 10 + "\r\nX-Injected: 1"]
)  # fmt: skip
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([-1, 0, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=50),
    ODD_TEXT,
)
ADVERSARIAL = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=5),
    st.dictionaries(st.text(max_size=10), SCALARS, max_size=5),
    st.integers(400, 900).map(nested),  # near the parser's recursion limit
    st.integers(400, 900).map(lambda d: nested(d, kind="{")),
    st.sampled_from([[0] * 100_000, ["x"] * 20_000, [[1, 2]] * 5_000, {str(i): 1.0 for i in range(5_000)}]),
)
"""Values no field expects, or a field's type at its extremes."""


@st.composite
def raw_bodies(draw, valid: dict[str, Any] | None) -> tuple[bytes, dict[str, str]]:
    """A whole body (and its headers) that is wrong as a whole."""
    json_type = {"content-type": "application/json"}
    kind = draw(st.sampled_from(["not json", "deep", "not an object", "wrong type", "bytes", "huge"]))
    if kind == "not json":
        text = draw(
            st.sampled_from(['{"model": ', "{'a': 1}", "[1,]", "NaN", "{" * 10, '{"a": 1}}', "\ufeff{}"])
        )
        return text.encode(), json_type
    if kind == "deep":
        depth = draw(st.sampled_from([1_000, 10_000, 100_000]))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return (opener * depth + "1" + closer * depth).encode(), json_type
    if kind == "not an object":
        return json.dumps(draw(SCALARS)).encode(), json_type
    if kind == "wrong type":
        body = json.dumps(valid or {}).encode()
        content_type = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded",
                                             "multipart/form-data; boundary=x", "", "application/json; charset=latin-1"]))  # fmt: skip
        return body, {"content-type": content_type}
    if kind == "bytes":
        return draw(st.binary(max_size=300)), json_type
    return b'{"prompt": "' + b"a" * (8 * 2**20 + 1) + b'"}', json_type  # over MAX_BODY_BYTES: 413


@st.composite
def attempts(draw, method: str, template: str, valid: dict | None, paths: list[tuple]):
    """``(path, body, headers)`` of one adversarial request to the route ``method template``:
    mostly ``valid`` with one of its ``paths`` set to an adversarial value, else a body wrong as
    a whole; sometimes an odd header."""
    headers = {}
    key = draw(KEYS)
    if key is not None:
        headers["authorization"] = key
    url_path = template
    if "{model}" in url_path:
        name = draw(st.one_of(MODELS, st.text(min_size=1, max_size=40)))
        url_path = url_path.replace("{model}", requests.utils.quote(name, safe="/"))
    if valid is not None and paths and draw(st.integers(0, 3)) > 0:
        body = put(copy.deepcopy(valid), draw(st.sampled_from(paths)), draw(ADVERSARIAL))
        raw = json.dumps(body, allow_nan=True).encode()
        headers["content-type"] = "application/json"
    elif method == "POST":
        raw, extra = draw(raw_bodies(valid))
        headers.update(extra)
    else:
        raw = draw(st.sampled_from([b"", b"{}", b"\x00" * 10]))
    if draw(st.integers(0, 9)) == 0:
        name = draw(st.sampled_from(["x-request-id", "accept", "user-agent", "x-forwarded-for"]))
        headers[name] = draw(st.sampled_from(["a" * 10_000, "\t", "é", "../"]))
    return url_path, raw, headers


def fuzz_route(gateway: FuzzGateway, session, tally: Tally, method: str, template: str, strategy) -> None:
    target = f"{method} {template}"

    @settings(FUZZ, max_examples=MUTATION_EXAMPLES)
    @given(strategy)
    def fuzz(case):
        url_path, raw, headers = case
        try:
            try:
                reply = session.request(
                    method, gateway.http + url_path, data=raw, headers=headers, timeout=CALL_TIMEOUT_S
                )
            except requests.ConnectionError:  # a kept-alive connection the server had closed: once more
                reply = requests.request(
                    method, gateway.http + url_path, data=raw, headers=headers, timeout=CALL_TIMEOUT_S
                )
        except requests.exceptions.InvalidHeader:
            tally.add(target, "refused by the client (invalid header)")
            return
        tally.add(target, reply.status_code)
        asked = f"{url_path} {headers} " + raw[:100_000].decode("utf-8", "replace")
        assert_clear(gateway, target, reply.status_code, reply.content, asked)

    fuzz()


def test_adversarial_values_in_every_field(request, gateway, document, session):
    tally = Tally("HTTP, hypothesis (adversarial values per field, malformed bodies, headers)")
    for method, path in app_operations(gateway):
        template = path.replace("{model:path}", "{model}")
        operation = document["paths"][template][method.lower()]
        schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        paths = field_paths(schema, document) if schema else []
        strategy = attempts(method, template, VALID_BODIES.get((method, path)), paths)
        fuzz_route(gateway, session, tally, method, template, strategy)
    still_serves(gateway)
    tally.report(request.config)


# -- the side port ---------------------------------------------------------------------------


def side_port_exchange(address: str, raw: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=CALL_TIMEOUT_S) as conn:
        try:
            conn.sendall(raw)
            conn.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading it all
        chunks = []
        while True:
            try:
                chunk = conn.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


SIDE_REQUESTS = st.one_of(
    st.builds(
        lambda method, path, junk: f"{method} {path} HTTP/1.1\r\nHost: x\r\n{junk}\r\n".encode("utf-8", "surrogatepass"),
        st.sampled_from(["GET", "HEAD", "POST", "DELETE", "get", "", "GET GET"]),
        st.one_of(st.sampled_from(["/healthz", "/readyz", "/metrics", "/", "/metrics?x=1", "*", "/" + "a" * 100_000]),
                  st.text(max_size=30)),
        st.sampled_from(["", "X: " + "a" * 70_000 + "\r\n", "Content-Length: -1\r\n", "\x00\r\n"]),
    ),
    st.binary(max_size=200),
)  # fmt: skip


def test_the_side_port(request, gateway):
    tally = Tally("HTTP side port, hypothesis (raw requests)")

    @settings(FUZZ, max_examples=SIDE_PORT_EXAMPLES)
    @given(SIDE_REQUESTS)
    def fuzz(raw):
        answer = side_port_exchange(gateway.side_http, raw)
        assert answer.startswith(b"HTTP/1.1 "), f"no answer to {raw[:200]!r}: {answer[:200]!r}"
        status = int(answer.split(b" ", 2)[1])
        tally.add("side port", status)
        assert status < 500, f"{status} to {raw[:200]!r}"

    fuzz()
    assert side_port_exchange(gateway.side_http, b"GET /readyz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200")
    tally.report(request.config)
