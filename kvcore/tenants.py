"""Tenants: whose blocks a store holds, and the share of its capacity each may keep.

Keys keep tenants' blocks apart (``cache_salt`` is in every key); tenants keep their
*capacity* apart. Each tenant the operator names has, in :class:`TenantSettings`:

- ``reserved_bytes``: bytes of its blocks no other tenant's write can evict. Room a tenant
  leaves unused is used by the others (the store stays work-conserving) and is given back by
  eviction when its owner needs it.
- ``quota_bytes``: the most it may ever hold. A write past it evicts the tenant's own least
  recently used blocks, never another tenant's; it is refused only where the tenant's own
  blocks cannot make the room (they are all being written).

Victims (:class:`TenantLRU`): when a write needs room, the least recently used block among
the tenants holding more than their reserved share; where no tenant does, the writer's own
least recently used block (it is then over its own share); where it has none, the write is
refused. A tenant's own victims always go in its own LRU order.

Requests map to tenants by :meth:`TenantSettings.tenant_of`: an explicit tenant name the
engine carries per request, else the tenant of the request's ``cache_salt``, else the default
tenant. A salt is a secret: the settings keep only its SHA-256 (given as ``salt_sha256``, or
read from ``salts_file`` or ``salts``), a request's salt is hashed to be looked up, and no salt
is in a name, figure, event, log line or file kvcore writes; a model's ``repr`` and dump leave
``salts`` out, and a bad entry is reported by its position, never its salt.

.. versionadded:: 0.3
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, OrderedDict
from collections.abc import Container, Hashable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

__all__ = [
    "CANNOT_CLEAR_TENANT",
    "DEFAULT_TENANT",
    "MAX_TENANTS",
    "OTHER_TENANTS",
    "TENANT_NAME",
    "UNKNOWN_TENANT",
    "TenantLRU",
    "TenantSettings",
    "TenantShare",
    "check_tenant_name",
    "tenant_gauges",
]

#: the tenant of every request no setting maps elsewhere
DEFAULT_TENANT = "default"
#: what a tenant's name may be: it becomes a metric label, an event field and a directory name
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: at most this many tenants: each is a label value of every per-tenant metric
MAX_TENANTS = 256
#: where tenants past :data:`MAX_TENANTS` are counted, in figures per tenant
OTHER_TENANTS = "other"
#: how the facade answers a clear of one tenant on a backend that cannot (no ``kvcore_clear_tenant``)
CANNOT_CLEAR_TENANT = "cannot clear one tenant's objects"
#: how a backend's answer to a clear of a tenant it never heard of begins (``kvcore_clear_tenant``)
UNKNOWN_TENANT = "unknown tenant"


def tenant_gauges(name: str, values: Mapping[str, float]) -> dict[str, float]:
    """A backend's figure per tenant (``values``: tenant -> value) as its stats name them,
    ``{"tenant_<name>.<tenant>": value}``, which :meth:`kvcore.metrics.Metrics.families` exports as the gauge
    ``<prefix>_backend_tenant_<name>{tenant}``. Past :data:`MAX_TENANTS` tenants, the
    smallest values are summed as ``other``, so a metric's label values stay bounded.

    .. versionadded:: 0.3
    """
    items = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
    out = {f"tenant_{name}.{t}": float(v) for t, v in items[:MAX_TENANTS]}
    rest = items[MAX_TENANTS:]
    if rest:
        key = f"tenant_{name}.{OTHER_TENANTS}"
        out[key] = out.get(key, 0.0) + float(sum(v for _, v in rest))
    return out


def check_tenant_name(name: object, field: str | None = None) -> str:
    """``name`` if it is a tenant's name (:data:`TENANT_NAME`), else a ValueError naming
    ``field`` (None: a validator's, whose error names the field already)."""
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        where = "" if field is None else f"{field}: "
        raise ValueError(
            f"{where}{name!r} is not a tenant name (1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit)"
        )
    return name


_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def _digest(salt: str) -> str:
    return hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()


def _salt_map(value: Any, where: str) -> dict[str, str]:
    """``value`` as salt -> tenant, each checked; an error says which entry, never its salt."""
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where}: must be an object of cache_salt -> tenant, got {type(value).__name__}"
        )
    for n, (salt, tenant) in enumerate(value.items()):
        if not isinstance(salt, str) or not salt:
            raise ValueError(f"{where}: entry {n}: a salt must be a non-empty string")
        check_tenant_name(tenant, f"{where}: entry {n}'s tenant")
    return dict(value)


def _read_salts_file(path: str) -> dict[str, str]:
    """The salt -> tenant map in the JSON file ``path`` (errors name the file, not a salt)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"salts_file: cannot read {path!r}: {exc.strerror or exc}") from None
    except ValueError:
        raise ValueError(f"salts_file: {path!r} is not a JSON object of salt -> tenant") from None
    return _salt_map(data, f"salts_file {path!r}")


class TenantShare(BaseModel):
    """One tenant's share of a store (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reserved_bytes: ByteSize = Field(
        default=ByteSize(0),
        ge=0,
        description="bytes of this tenant's blocks no other tenant's write can evict",
    )
    quota_bytes: ByteSize | None = Field(
        default=None,
        gt=0,
        description="the most this tenant may hold (None: no bound but the store's)",
    )

    @field_validator("reserved_bytes", "quota_bytes", mode="before")
    @classmethod
    def _not_negative(cls, value: Any) -> Any:
        # ByteSize reads "-1" as a string it cannot parse: say what is wrong with it; and True
        # is no size (Python's bool is an int)
        if isinstance(value, bool):
            raise ValueError("must be a number of bytes, not a boolean")
        number = value.strip() if isinstance(value, str) else value
        if isinstance(number, str):
            try:
                number = float(number)
            except ValueError:
                return value
        if isinstance(number, (int, float)) and not isinstance(number, bool) and number < 0:
            raise ValueError(f"must be a number of bytes >= 0, got {value!r}")
        return value

    @model_validator(mode="after")
    def _quota_covers_reservation(self) -> TenantShare:
        if self.quota_bytes is not None and self.quota_bytes < self.reserved_bytes:
            raise ValueError(
                f"quota_bytes ({int(self.quota_bytes)}) is below reserved_bytes "
                f"({int(self.reserved_bytes)}): a tenant cannot be kept below what it is "
                "guaranteed"
            )
        return self


#: the share of a tenant the settings do not name: nothing reserved, no quota
NO_SHARE = TenantShare()


class TenantSettings(BaseModel):
    """Which tenant a request belongs to, and each tenant's share of the store.

    Example (a store of 64 GiB)::

        {"tenants": {"chat": {"reserved_bytes": "32GiB"},
                     "batch": {"quota_bytes": "16GiB"}},
         "salts_file": "/etc/kvcore/salts.json"}

    Salts map to tenants in one of three ways, all kept only as SHA-256 digests once read:
    ``salt_sha256`` (the digest of each salt, hex: the settings hold no salt at all),
    ``salts_file`` (the path of a JSON object of salt -> tenant, read once) or ``salts`` (the
    salts themselves). Engines print their connector's settings in their logs (vLLM logs its
    ``kv_connector_extra_config``), so ``salts`` there shows every salt: give the digests or a
    file instead.
    """

    # an error's input would carry salts (secrets): errors name the field and say why only
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    tenants: dict[str, TenantShare] = Field(
        default_factory=dict, description="each named tenant's share"
    )
    salt_sha256: dict[str, str] = Field(
        default_factory=dict,
        description="SHA-256 of a cache_salt (64 hex digits) -> its tenant",
    )
    salts_file: str | None = Field(
        default=None,
        description="a JSON file of cache_salt -> tenant, read once (its salts kept as digests)",
    )
    salts: dict[str, str] = Field(
        default_factory=dict,
        repr=False,  # secrets: never printed, never dumped
        exclude=True,
        description="cache_salt -> tenant (an engine that logs its settings logs these: prefer "
        "salt_sha256 or salts_file)",
    )
    default_tenant: str = Field(
        default=DEFAULT_TENANT, description="the tenant of requests nothing maps elsewhere"
    )
    #: every salt's tenant, by the salt's SHA-256 (hex)
    _by_digest: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("tenants", mode="before")
    @classmethod
    def _check_tenant_names(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            if len(value) > MAX_TENANTS:
                raise ValueError(f"at most {MAX_TENANTS} tenants, got {len(value)}")
            for name in value:
                check_tenant_name(name)
        return value

    @field_validator("salts", mode="before")
    @classmethod
    def _check_salts(cls, value: Any) -> Any:
        # checked here, before pydantic, whose errors would carry the salt (a dict's key) in
        # their location
        return _salt_map(value, "salts")

    @field_validator("salt_sha256", mode="before")
    @classmethod
    def _check_digests(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise ValueError(f"must be an object of digest -> tenant, got {type(value).__name__}")
        for n, (digest, tenant) in enumerate(value.items()):
            if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
                raise ValueError(f"entry {n}: not a SHA-256 digest (64 hex digits)")
            check_tenant_name(tenant, f"entry {n}'s tenant")
        return {d.lower(): t for d, t in value.items()}

    @model_validator(mode="after")
    def _salts_name_tenants(self) -> TenantSettings:
        check_tenant_name(self.default_tenant, "default_tenant")
        by_digest = dict(self.salt_sha256)
        by_digest.update({_digest(salt): tenant for salt, tenant in self.salts.items()})
        if self.salts_file is not None:
            by_digest.update(
                {_digest(salt): t for salt, t in _read_salts_file(self.salts_file).items()}
            )
        known = set(self.tenants) | {self.default_tenant}
        for n, tenant in enumerate(by_digest.values()):
            if tenant not in known:
                raise ValueError(
                    f"salts: entry {n} maps to tenant {tenant!r}, which 'tenants' does not "
                    f"name (named: {sorted(known)})"
                )
        self._by_digest = by_digest
        return self

    def share(self, tenant: str) -> TenantShare:
        """``tenant``'s share (:data:`NO_SHARE` for one the settings do not name)."""
        return self.tenants.get(tenant, NO_SHARE)

    @property
    def reserved_bytes(self) -> int:
        """Every tenant's reservation, summed."""
        return sum(int(s.reserved_bytes) for s in self.tenants.values())

    def check_capacity(self, capacity_bytes: int, field: str = "tenants") -> None:
        """Refuse reservations the store cannot hold, in one line naming ``field``."""
        if self.reserved_bytes > capacity_bytes:
            raise ValueError(
                f"{field}: the reserved shares sum to {self.reserved_bytes} bytes, over the "
                f"store's capacity of {capacity_bytes} bytes"
            )

    def tenant_of(self, *, tenant: str | None = None, salt: str | None = None) -> str:
        """The tenant of a request that names ``tenant`` or carries ``salt`` (its
        ``cache_salt``): a tenant the settings name first, then the salt's, else the default
        tenant. A name the settings do not know (or that is no tenant name) is ignored: a
        request's parameter is a user's, and the tenant only decides figures and shares, never
        what a request may read (its key does)."""
        if tenant is not None and (tenant in self.tenants or tenant == self.default_tenant):
            return tenant
        if salt:
            found = self._by_digest.get(_digest(salt))
            if found is not None:
                return found
        return self.default_tenant

    def names(self) -> list[str]:
        """Every tenant a request can map to: the named ones and the default."""
        return sorted(set(self.tenants) | {self.default_tenant})

    def check_known(self, tenant: str, field: str = "tenant") -> str:
        """``tenant`` if a request can map to it, else a ValueError naming ``field``."""
        check_tenant_name(tenant, field)
        if tenant not in self.tenants and tenant != self.default_tenant:
            raise ValueError(f"{field}: unknown tenant {tenant!r} (known: {self.names()})")
        return tenant


K = TypeVar("K", bound=Hashable)


class TenantLRU(Generic[K]):
    """Sized entries in one least-recently-used order per tenant, with victims chosen by the
    tenants' shares (the module docstring's rule). Not thread-safe: its owner locks.

    Entries are whatever identifies a stored unit (a block's id); each belongs to one tenant.
    """

    def __init__(self, settings: TenantSettings) -> None:
        self.settings = settings
        self._lru: dict[str, OrderedDict[K, tuple[int, int]]] = {}  # tenant -> key -> (tick, size)
        self._owner: dict[K, str] = {}
        self._tick = 0
        #: bytes each tenant holds
        self.used: Counter[str] = Counter()
        self._reserved = {t: int(s.reserved_bytes) for t, s in settings.tenants.items()}
        self._quota = {
            t: int(s.quota_bytes) for t, s in settings.tenants.items() if s.quota_bytes is not None
        }

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    @property
    def total_bytes(self) -> int:
        return sum(self.used.values())

    def owner(self, key: K) -> str | None:
        return self._owner.get(key)

    def entries(self, tenant: str) -> list[K]:
        """``tenant``'s entries, least recently used first."""
        return list(self._lru.get(tenant, ()))

    def add(self, key: K, tenant: str, size: int) -> None:
        """``key`` (``size`` bytes) is stored for ``tenant``: the most recently used."""
        if key in self._owner:
            self.remove(key)
        self._tick += 1
        self._lru.setdefault(tenant, OrderedDict())[key] = (self._tick, size)
        self._owner[key] = tenant
        self.used[tenant] += size

    def touch(self, keys: Iterable[K]) -> None:
        """``keys`` were read (in this order): each becomes its tenant's most recently used."""
        for key in keys:
            tenant = self._owner.get(key)
            if tenant is None:
                continue
            lru = self._lru[tenant]
            self._tick += 1
            lru[key] = (self._tick, lru[key][1])
            lru.move_to_end(key)

    def remove(self, key: K) -> int:
        """Forget ``key``; the bytes it held (0: not here)."""
        tenant = self._owner.pop(key, None)
        if tenant is None:
            return 0
        _, size = self._lru[tenant].pop(key)
        self.used[tenant] -= size
        if not self.used[tenant]:
            del self.used[tenant]
        return size

    def over_quota(self, tenant: str, nbytes: int) -> bool:
        """Whether ``tenant`` storing ``nbytes`` more would exceed its quota."""
        quota = self._quota.get(tenant)
        return quota is not None and self.used[tenant] + nbytes > quota

    def over_share(self, tenant: str) -> int:
        """Bytes ``tenant`` holds beyond its reserved share (0 or less: within it)."""
        return self.used[tenant] - self._reserved.get(tenant, 0)

    def own_victim(self, tenant: str, keep: Container[K] = ()) -> K | None:
        """``tenant``'s least recently used entry not in ``keep`` (a quota's victim)."""
        return next((k for k in self._lru.get(tenant, ()) if k not in keep), None)

    def victim(self, writer: str, keep: Container[K] = ()) -> K | None:
        """The entry to evict so that ``writer`` can store more: the least recently used
        entry (not in ``keep``: being written) among the tenants over their reserved share;
        where none is, ``writer``'s own least recently used; None where neither exists (the
        write is refused)."""
        best: tuple[int, K] | None = None
        for tenant, lru in self._lru.items():
            if self.over_share(tenant) <= 0:
                continue
            for key, (tick, _) in lru.items():
                if key in keep:
                    continue
                if best is None or tick < best[0]:
                    best = (tick, key)
                break
        if best is not None:
            return best[1]
        return self.own_victim(writer, keep)
