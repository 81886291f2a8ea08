"""Errors raised while opening or decoding a video source."""


class VideoError(ValueError):
    """A video source cannot be read: wrong type, corrupt, truncated, without frames."""


class VideoNotFoundError(VideoError, FileNotFoundError):
    """The path given as a video source does not exist."""
