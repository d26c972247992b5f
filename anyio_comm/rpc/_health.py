"""The health service every RPC server answers: whether it serves, as a whole
or one named service of it, for load balancers and orchestrators.

A CALL of the method :data:`HEALTH_METHOD` with no argument (the server as a
whole) or one str (a service's name) is answered at once by the connection's
reader, whatever runs or waits, with one of :class:`HealthStatus`'s values
(see the RPC guide).
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["HEALTH_METHOD", "HealthStatus"]

#: the method name of the health service (no handler may take it)
HEALTH_METHOD: Final = "rpc.health"


class HealthStatus(str, enum.Enum):
    """What a server says of its health (:meth:`Client.check_health
    <anyio_comm.rpc.Client.check_health>`)."""

    #: it takes calls
    SERVING = "serving"
    #: it shuts down, or ``Server.set_serving`` said so (which changes
    #: nothing else: the server still takes calls then)
    NOT_SERVING = "not-serving"
    #: it knows no service of that name
    UNKNOWN = "unknown"
