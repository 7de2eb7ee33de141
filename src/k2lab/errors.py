"""Errors that the command line reports in one paragraph (exit code 2) instead of a traceback."""


class K2LabError(Exception):
    """Base class for user-facing errors: bad configs, checkpoints, requests."""


class CheckpointError(K2LabError):
    """A checkpoint directory that cannot be read: missing files, bad JSON, missing/unexpected/mis-shaped tensors."""
