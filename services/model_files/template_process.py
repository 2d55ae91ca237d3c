"""A process that renders chat templates, seen from the process that sends it the renders.

A thread cannot be stopped in Python, and a render is the template's own code: the gateway
renders in processes of its own (:mod:`.template_worker`), which the kernel holds to the
budget's CPU time and memory, and which can be replaced when a render kills them. Renders and
their answers travel as frames on the child's stdin and stdout: 4 bytes of length (big-endian),
then that many bytes of JSON. JSON, not pickle, both ways: what comes back was made by a
template's code, and decoding it must not run any.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from services.model_files.chat_template import ChatTemplateError, TemplateOverBudget
from services.model_files.template_budget import TemplateBudget

MAX_FRAME_BYTES = 256 * 2**20
"""Largest frame read: a render's text is bounded by its output budget (JSON at most doubles a
string's length, and escapes up to six bytes per character); past this the child is broken."""

_SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The directory holding ``services``: the child imports its modules from there."""


def write_frame(stream: IO[bytes], message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(len(data).to_bytes(4, "big") + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next frame, or None at the end of the stream (or a frame cut short)."""
    header = stream.read(4)
    if len(header) < 4:
        return None
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME_BYTES:
        return None
    data = stream.read(size)
    return json.loads(data) if len(data) == size else None


class TemplateProcess:
    """One render process, used by one thread at a time: started on first use, and again on
    the next use after a render killed it."""

    def __init__(self, budget: TemplateBudget):
        self.budget = budget
        self._child: subprocess.Popen | None = None
        self._closed = False
        self._lock = threading.Lock()  # close() may come from another thread than render()

    def render(self, source: str, variables: dict[str, Any]) -> str:
        """``source`` rendered with ``variables`` (JSON values) in the child, blocking until it
        answers. Raises :class:`TemplateOverBudget` or :class:`ChatTemplateError` as
        :func:`~.chat_template.render_chat_template` does, and :class:`TemplateOverBudget` when the
        render made the kernel kill the child (its CPU time)."""
        child = self._running()
        try:
            write_frame(child.stdin, {"template": source, "variables": variables})
            reply = read_frame(child.stdout)
        except (OSError, ValueError):  # the child went away mid-frame
            reply = None
        if reply is None:
            raise self._died(child)
        if "text" in reply:
            return reply["text"]
        if "over_budget" in reply:
            raise TemplateOverBudget(reply["over_budget"], reply["setting"])
        raise ChatTemplateError(reply["refused"])

    def close(self) -> None:
        """Ends the child; a render in progress fails."""
        with self._lock:
            self._closed, child, self._child = True, self._child, None
        if child is not None:
            _end(child)

    @property
    def pid(self) -> int | None:
        """The running child's process id, if one runs."""
        child = self._child
        return child.pid if child is not None else None

    def _running(self) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise ChatTemplateError("the gateway's template renderer is closed")
            if self._child is None:
                self._child = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "services.model_files.template_worker",
                        json.dumps(asdict(self.budget)),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(_python_path())},
                )
            return self._child

    def _died(self, child: subprocess.Popen) -> ChatTemplateError:
        """Reaps ``child``, so that the next render starts another; what to tell the caller."""
        status = _end(child)
        with self._lock:
            if self._child is child:
                self._child = None
        if status == -signal.SIGXCPU:
            return TemplateOverBudget(
                f"more than {self.budget.chat_template_cpu_s} CPU seconds", "chat_template_cpu_s"
            )
        return ChatTemplateError(f"the render process ended ({_status_words(status)})")


def _end(child: subprocess.Popen) -> int:
    """Kills ``child`` if it still runs, reaps it and closes its pipes; its exit status."""
    child.kill()
    status = child.wait()
    for pipe in (child.stdin, child.stdout):
        with contextlib.suppress(OSError):  # a frame still buffered for a reader that is gone
            pipe.close()
    return status


def _python_path() -> list[str]:
    inherited = os.environ.get("PYTHONPATH", "")
    return [str(_SOURCE_ROOT), *(p for p in inherited.split(os.pathsep) if p)]


def _status_words(status: int) -> str:
    if status < 0:
        return f"killed by {signal.Signals(-status).name}"
    return f"exit status {status}"
