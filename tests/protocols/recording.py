"""A bare client-server (``L``) connection that records every message it receives, for tests."""

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
