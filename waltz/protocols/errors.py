"""Errors raised while decoding or negotiating the binary wire formats.

Every error carries a message that names the problem, because the protocol
classes log it as the reason for closing the connection.
"""


class ProtocolError(Exception):
    """The peer sent bytes that violate a wire format; the connection must close."""


class DecodeError(ProtocolError):
    """A payload could not be decoded (short or overlong body, bad value)."""


class UnknownMessageType(DecodeError):
    """A frame carried a message type code this family does not define."""


class UnexpectedMessageType(DecodeError):
    """A frame carried a message type of the family that this side of the connection never receives (a
    response sent to a server, say); refused before its body is decoded."""


class ChecksumError(DecodeError):
    """A checksum carried in a message does not match the bytes it covers."""


class FrameError(ProtocolError):
    """A frame header is wrong: bad magic, unsupported version, bad length."""


class HandshakeError(ProtocolError):
    """The Hello exchange failed: no common version, or a second Hello."""
