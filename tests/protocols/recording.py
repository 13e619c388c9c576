"""For tests: a bare client-server (``L``) connection that records every message it receives, and a recorder
of the reasons any connection is closed with."""

from waltz.protocols import client_messages as cm
from waltz.protocols.base import WaltzProtocol


class RecordingClient(WaltzProtocol):
    codec = cm.CLIENT_CODEC
    hello_name = "Waltz Client"

    def __init__(self):
        super().__init__()
        self.received = []

    def messageReceived(self, message):
        self.received.append(message)


def closing_reasons(proto):
    """The reasons ``proto`` (any :class:`WaltzProtocol`) is closed with, as they come."""
    reasons, close = [], proto.close
    proto.close = lambda reason, *args, **kwargs: (reasons.append(reason), close(reason, *args, **kwargs))
    return reasons
