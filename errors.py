"""The project's error hierarchy: every error we raise on purpose is a SwarmpipeError."""

from __future__ import annotations


class SwarmpipeError(Exception):
    """Base of every error swarmpipe raises on purpose; its message tells the user what to do."""


class ConfigError(SwarmpipeError):
    """A configuration file, flag or run spec is invalid."""


class CodecError(SwarmpipeError):
    """A tensor could not be encoded or its wire form does not decode."""


class PeerError(SwarmpipeError):
    """A peer sent something malformed or hostile, or a hop failed."""


class CoordinatorUnavailable(SwarmpipeError):
    """The coordinator did not answer within the deadline."""


class NotAdmitted(SwarmpipeError):
    """The run refused this node: no valid join token, or the organiser revoked it."""


class DataError(SwarmpipeError):
    """The training corpus cannot be read or is too small for the run."""


class CheckpointError(SwarmpipeError):
    """Stage checkpoints are missing, corrupt, or do not form one step of one run."""


class ModelFileError(SwarmpipeError):
    """An exported model file is missing, unreadable, or not one swarmpipe wrote."""
