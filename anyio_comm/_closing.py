"""How a comm closes its transport: the close record first where one can go,
then a graceful close or an abort, each bounded in time.

A close record says why the comm closes (see ``docs/wire-format.md``). It goes
only to a peer that announced the ``CLOSE_REASONS`` capability, only when no
send is under way (a record cannot go in the middle of a message) and our side
did not send EOF, and it is given :data:`CLOSE_RECORD_TIMEOUT` to be written (a
peer that reads nothing can leave the socket unable to take even these bytes).
A graceful close (TLS sends close_notify) is given that time again, and the
transport is aborted when it runs out.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

from anyio import aclose_forcefully, move_on_after

from ._sansio.connection import ConnectionState
from ._sansio.wire import Capability

if TYPE_CHECKING:
    from ._sansio.close import CloseReason
    from ._sansio.connection import Connection
    from ._transports.base import Transport
    from ._util import ConflictDetector

__all__ = ["CLOSE_RECORD_TIMEOUT", "close_transport", "send_close_record"]

logger = logging.getLogger("anyio_comm")

#: seconds a comm that closes gives its close record to be written, and then
#: its transport's graceful close
CLOSE_RECORD_TIMEOUT: Final = 1.0


async def close_transport(transport: Transport, *, graceful: bool) -> None:
    """Close ``transport`` gracefully (aborted if that takes longer than
    :data:`CLOSE_RECORD_TIMEOUT`: a byte stream may wait for its peer's TLS
    close_notify), or abort it. Call it shielded; it never raises."""
    if graceful:
        with move_on_after(CLOSE_RECORD_TIMEOUT) as scope:
            await transport.aclose()
        if not scope.cancelled_caught:
            return
    transport.abort()
    await aclose_forcefully(transport)


async def send_close_record(
    transport: Transport,
    conn: Connection,
    send_guard: ConflictDetector,
    reason: CloseReason,
    peer_address: str,
) -> bool | None:
    """Write a close record saying ``reason``. Return ``None`` when the peer
    does not accept close records (or its preamble has not arrived), else
    whether the record was written: not when a send is under way
    (``send_guard`` is held) or our side sent EOF, nor when the transport did
    not take it within :data:`CLOSE_RECORD_TIMEOUT`. Call it shielded; it
    never raises."""
    if not conn.peer_accepts(Capability.CLOSE_REASONS):
        return None
    if send_guard.held or conn.our_state is not ConnectionState.OPEN:
        return False
    send_guard.held = True
    try:
        record = conn.close_record(reason)
        with move_on_after(CLOSE_RECORD_TIMEOUT):
            await transport.send_all([record])
            return True
        logger.debug("the close record to %s was not taken in time", peer_address)
    except Exception as exc:
        logger.debug("the close record to %s was not sent: %r", peer_address, exc)
    finally:
        send_guard.held = False
    return False
