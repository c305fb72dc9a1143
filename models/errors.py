"""Errors raised by the model layer. Each names the file at fault and how to fix it."""


class ModelError(Exception):
    """Base class for model-layer failures."""


class WeightFileError(ModelError):
    """A weight file is missing, unreadable, or does not match its recorded sha256."""


class ModelFormatError(ModelError):
    """A weight file is readable but its contents are not what the reader expects (corrupt or truncated)."""


class ProviderUnavailable(ModelError):
    """The configuration requires an execution provider (CUDA) that this machine cannot run."""
