"""Errors raised while opening or decoding a video source."""


class VideoError(ValueError):
    """A video source cannot be read: wrong type, corrupt, truncated, without frames."""


class VideoNotFoundError(VideoError, FileNotFoundError):
    """The path given as a video source does not exist."""


class FrameDecodeError(VideoError):
    """A frame in the middle of a source cannot be decoded or read.

    index: the frame's index in the source; timestamp: its time in seconds (estimated from the frame rate
    when the decoder stopped before it). encoded: set by `statekv.VideoQA.encode` to the `EncodedVideo` of
    every sampled frame before this one, which can still be asked; None elsewhere.
    """

    def __init__(self, message: str, *, index: int, timestamp: float):
        super().__init__(message)
        self.index = index
        self.timestamp = timestamp
        self.encoded = None
