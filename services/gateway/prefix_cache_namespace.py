"""Whose cached prompt KV a request may share: the prefix-cache namespace the gateway names for
it (issue 50).

A prompt in a worker's prefix cache makes the next request starting with it faster, so shared
blocks tell one caller what another sent. The gateway, which knows the caller's tenant from its
API key, therefore names the namespace itself: the tenant by default, so blocks are shared only
within a tenant; or, when the client passes vLLM's ``cache_salt``, the salt, so requests that
pass the same salt share whatever tenant sends them (the salt is then a shared secret). A client
never names a namespace: one prefix for tenants and another for salts keeps a salt from ever
naming a tenant's namespace. docs/security.md says what timing still tells.
"""

from __future__ import annotations

from services.runtime.sampling.request_validation import InvalidField

MAX_CACHE_SALT_BYTES = 256
"""Longest ``cache_salt``, in UTF-8 bytes: room for any random secret, bounded work to hash."""


def check_cache_salt(cache_salt: str) -> None:
    """InvalidField naming ``cache_salt`` past :data:`MAX_CACHE_SALT_BYTES`."""
    if len(cache_salt) > MAX_CACHE_SALT_BYTES:  # a character is at least one byte
        size = f"over {MAX_CACHE_SALT_BYTES}"
    elif (encoded := len(cache_salt.encode("utf-8", "surrogatepass"))) > MAX_CACHE_SALT_BYTES:
        size = str(encoded)
    else:
        return
    raise InvalidField("cache_salt", f"cache_salt is {size} bytes; the limit is {MAX_CACHE_SALT_BYTES}")


def prefix_cache_namespace(tenant: str, cache_salt: str) -> str:
    """The worker's ``prefix_cache_namespace`` for a request of ``tenant`` passing ``cache_salt``
    ("" for none), checked."""
    if not cache_salt:
        return f"tenant:{tenant}"
    check_cache_salt(cache_salt)
    return f"salt:{cache_salt}"
