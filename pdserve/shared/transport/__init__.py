"""KV-block transfer between a prefill pod and a decode pod (asyncio TCP; docs/design.md §3).

``frames`` defines the wire, ``handshake`` the layout check and mutual authentication, ``server``
the decode side (calling a :class:`KVReceiver`), ``client`` the prefill side. ``connector`` chooses how
block bytes travel (``tcp``, ``shm``, ``loopback``) by name: :class:`KVConnectorFactory`.
"""

from pdserve.shared.transport.client import KVTransferClient, KVTransferError
from pdserve.shared.transport.connector import KVConnector, KVConnectorError, KVConnectorFactory, KVTransferConfig
from pdserve.shared.transport.frames import (
    Abort, Blocks, Commit, CommitReply, FrameError, FrameLimits, FrameTooLarge, MalformedFrame, Reserve,
    ReserveReply, TruncatedFrame,
)
from pdserve.shared.transport.handshake import HandshakeError
from pdserve.shared.transport.layout import KVLayout
from pdserve.shared.transport.pool import KVClientPool
from pdserve.shared.transport.receiver import KVReceiver
from pdserve.shared.transport.server import KVTransferServer

__all__ = [
    "Abort", "Blocks", "Commit", "CommitReply", "FrameError", "FrameLimits", "FrameTooLarge", "HandshakeError",
    "KVClientPool", "KVConnector", "KVConnectorError", "KVConnectorFactory", "KVLayout", "KVReceiver",
    "KVTransferClient", "KVTransferConfig", "KVTransferError", "KVTransferServer", "MalformedFrame", "Reserve",
    "ReserveReply", "TruncatedFrame",
]
