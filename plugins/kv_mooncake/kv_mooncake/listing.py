"""The names of what a Mooncake store holds, from the master's key listing.

Mooncake's client cannot list keys; its master can (``GET /get_all_keys`` on the HTTP port,
``--metrics_port``: every key, one per line, ~170 ms and 4.8 MB for 200,000 keys here). A key
is a name as the backend stored it (:mod:`kv_mooncake.store_keys`): a plain key *is* the
object's name; a key that is a digest of a long or unusual name is named again by its
metadata companion (:mod:`kv_mooncake.block_meta`, read once and remembered), and is left out
when it has none (it was written without metadata: nothing can say its name). Companions and
other namespaces' keys are not objects of this namespace.

A listing's time follows the cluster's size, so its bound does too: the master's key count
(``master_key_count`` on ``/metrics``, asked within the connect timeout, which still tells a
master that hangs) times :data:`LISTING_S_PER_KEY`, on top of the connect timeout. A bound of
the connect timeout alone (2 s) refused every listing of a cluster of 1,000,000 keys.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence

from kv_mooncake import block_meta
from kv_mooncake.connect import http_get
from kv_mooncake.store_keys import namespace_prefix

__all__ = ["LISTING_S_PER_KEY", "StoreListing"]

log = logging.getLogger("kvcore.mooncake")

#: companions read per call when naming digest keys (one copy-buffer's worth at most)
_READ_CHUNK = 512
#: seconds a listing may take per key of the cluster, past the connect timeout: the master
#: lists ~0.85 ms per 1,000 keys and this side parses them as fast (measured here), and a busy
#: machine may be ten times slower (1,000,000 keys: 40 s)
LISTING_S_PER_KEY = 40e-6
_KEY_COUNT = re.compile(rb"^master_key_count\s+([0-9.eE+]+)\s*$", re.MULTILINE)


class StoreListing:
    """The names of one namespace's objects (``key_scheme="namespaced"``), or of every plain
    object in the cluster (``"as_is"``: callers filter by identity).

    :param url: the master's ``/get_all_keys``.
    :param read_companions: the companions of keys (bytes per key, ``b""`` for none:
        :class:`kv_mooncake.companions.CompanionReader`).
    :param key_of: the key the backend stores a name under: a companion is believed only
        for the key its name maps to.
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        namespaced: bool,
        timeout_s: float,
        read_companions: Callable[[list[str]], Sequence[bytes]],
        key_of: Callable[[str], str],
    ) -> None:
        self.url = url
        self._prefix = namespace_prefix(namespace) if namespaced else ""
        self._timeout_s = timeout_s
        self._read = read_companions
        self._key_of = key_of
        self._digest_names: dict[str, str] = {}  # digest key -> the name its companion gives
        self.unnamed = 0  # digest keys of the last listing that nothing could name

    def bound_s(self) -> float:
        """How long the next listing may take: the connect timeout, plus the cluster's key
        count (asked within the connect timeout) times :data:`LISTING_S_PER_KEY` (an OSError
        or ValueError when the master does not answer)."""
        metrics = self.url.rsplit("/", 1)[0] + "/metrics"
        found = _KEY_COUNT.search(http_get(metrics, self._timeout_s))
        keys = float(found.group(1)) if found else 0.0
        return self._timeout_s + LISTING_S_PER_KEY * keys

    def keys(self) -> list[str]:
        """Every key of the namespace the master lists now, companions excluded (an OSError
        or ValueError when the master does not answer)."""
        body = http_get(self.url, self.bound_s()).decode("utf-8", "surrogateescape")
        prefix = self._prefix
        return [
            key for key in body.split("\n")
            if key.startswith(prefix) and key and not block_meta.is_meta_key(key)
        ]  # fmt: skip

    def names(self) -> dict[str, str]:
        """``{key: name}`` of every object of the namespace stored now."""
        out: dict[str, str] = {}
        digests: list[str] = []
        for key in self.keys():
            if "#" in key:
                digests.append(key)
            else:
                out[key] = key
        out.update(self._name_digest_keys(digests))
        return out

    def _name_digest_keys(self, keys: Iterable[str]) -> dict[str, str]:
        known = self._digest_names
        listed = list(keys)
        unread = [k for k in listed if k not in known]
        for lo in range(0, len(unread), _READ_CHUNK):
            chunk = unread[lo : lo + _READ_CHUNK]
            blobs = self._read([block_meta.meta_key(k) for k in chunk])
            for key, blob in zip(chunk, blobs, strict=True):
                decoded = block_meta.decode(blob) if blob else None
                if decoded is not None and self._key_of(decoded[0]) == key:
                    known[key] = decoded[0]
        # forget keys no longer stored, so the table never outgrows the store
        self._digest_names = {k: known[k] for k in listed if k in known}
        self.unnamed = len(listed) - len(self._digest_names)
        return self._digest_names
