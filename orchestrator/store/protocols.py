"""Protocol versions: every (name, version) the database has seen, with its content hash."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import func, select

from orchestrate.api.protocol import Protocol, ProtocolError
from orchestrate.api.records import utcnow
from orchestrate.db.models import ProtocolRow
from orchestrate.store.sessions import Sessions


class ProtocolsMixin(Sessions):
    """The protocols table: a version, once recorded, may never change its content."""

    def register_protocol(self, protocol: Protocol) -> None:
        """Record this protocol version; refuse one whose (name, version) was seen with other
        content: a changed protocol must be a new version, or old results silently change."""
        digest = protocol.content_hash()
        with self._write() as s:
            known = s.scalar(
                select(ProtocolRow).where(
                    ProtocolRow.name == protocol.name, ProtocolRow.version == protocol.version
                )
            )
            if known is not None:
                if known.protocol_hash != digest:
                    raise ProtocolError(
                        f"protocol {protocol.name!r} v{protocol.version} is recorded with hash "
                        f"{known.protocol_hash}, but this file hashes to {digest}: a changed "
                        f"protocol needs a new version (runs under v{protocol.version} used "
                        "the old)"
                    )
                return
            s.add(
                ProtocolRow(
                    name=protocol.name,
                    version=protocol.version,
                    protocol_hash=digest,
                    protocol_json=protocol.model_dump_json(),
                    created_at=utcnow(),
                )
            )

    def next_protocol_version(self, protocol: Protocol) -> int:
        """The number a new version derived from `protocol` takes: past every version of its
        name the database has seen, so a second derivation never collides with the first."""
        with self._read() as s:
            latest = s.scalar(
                select(func.max(ProtocolRow.version)).where(ProtocolRow.name == protocol.name)
            )
        return max(protocol.version, latest or 0) + 1

    def recorded_protocols(self) -> list[dict[str, Any]]:
        """Every protocol version the database has seen, oldest first: name, version, hash,
        created_at and the decoded protocol."""
        with self._read() as s:
            rows = s.scalars(select(ProtocolRow).order_by(ProtocolRow.created_at, ProtocolRow.id))
            return [
                {
                    "name": r.name,
                    "version": r.version,
                    "hash": r.protocol_hash,
                    "created_at": r.created_at,
                    "protocol": json.loads(r.protocol_json),
                }
                for r in rows
            ]
