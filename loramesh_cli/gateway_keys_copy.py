"""The gateways' tenants file under ``loramesh up``: a copy of ``--api-keys-file`` with every key
hashed and the admin key added, in an owner-only file of the state directory. ``up`` keeps the
copy in step with the user's file, so an edit reaches the gateways (which reload their tenants
file live) without a restart."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.auth import TenantsFile, hashed_keys
from services.runtime.errors import InvalidArgument
from services.runtime.security.private_files import write_private_text

log = logging.getLogger("loramesh.up")

FOLLOW_INTERVAL_S = 1.0
"""How often ``up`` looks at the user's tenants file: as often as a gateway looks at its copy."""


@dataclass
class GatewayKeysCopy:
    """``path``: the gateways' copy; ``source``: the user's ``--api-keys-file`` (None: the admin
    key alone)."""

    path: Path
    admin_api_key: str
    admin_tenant: str
    source: Path | None = None
    _copied: bytes | None = field(default=None, init=False)
    """The source's bytes the copy was last made from."""

    def write(self) -> Path:
        """Makes the copy; ``InvalidArgument`` naming ``--api-keys-file`` when it cannot be read."""
        text = self.source.read_bytes() if self.source is not None else b"{}"
        self._write(text)
        return self.path.resolve()

    def refresh(self) -> None:
        """Copies the source again when it changed. A source that cannot be read or parsed leaves
        the copy (and the keys in force) as it is: the gateways do the same with their file."""
        if self.source is None:
            return
        try:
            text = self.source.read_bytes()
            if text != self._copied:
                self._write(text)
                log.warning("%s changed: the gateways' keys and limits follow it", self.source)
        except InvalidArgument as error:
            if text != self._copied:
                log.error("%s; the keys and limits in force are kept", error.message)
                self._copied = text
        except OSError as error:
            log.error("--api-keys-file: %s; the keys and limits in force are kept", error)

    async def follow(self, stop: asyncio.Event) -> None:
        """:meth:`refresh` every :data:`FOLLOW_INTERVAL_S` until ``stop`` is set."""
        while not stop.is_set():
            await asyncio.to_thread(self.refresh)
            try:
                await asyncio.wait_for(stop.wait(), FOLLOW_INTERVAL_S)
            except TimeoutError:
                pass

    def _write(self, text: bytes) -> None:
        keys = {self.admin_api_key: self.admin_tenant}
        given = TenantsFile({})
        if self.source is not None:
            try:
                given = TenantsFile.parse(json.loads(text), str(self.source))
            except ValueError as error:  # not JSON
                raise InvalidArgument(f"--api-keys-file {self.source}: {error}") from None
            keys.update(given.keys)
        write_private_text(
            self.path, json.dumps(TenantsFile(hashed_keys(keys), given.quotas).to_json(), indent=2)
        )
        self._copied = text
