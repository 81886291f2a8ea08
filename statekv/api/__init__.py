"""The front door: what a user holds and the files it is saved to.

`VideoQA` (`videoqa`) loads a model once under a method and makes videos and streams; `EncodedVideo` (`encoded`)
is a video streamed through the model and answers questions from it, with its `EncodingStats` (`stats`);
`Stream` (`stream`) is one fed frame by frame, several pushed together by `VideoQA.push_many` (`pushing`). A
stream's file (`stream_file`: the format, verified; `saving`: `Stream.save` and `Stream.load`), and on the disk
tier its own description (`stream_disk`) and journal records (`durability`).
"""

from .encoded import EncodedVideo
from .stats import AnswerInfo, EncodingStats
from .stream import Stream
from .videoqa import VideoQA, make_policy

__all__ = ["AnswerInfo", "EncodedVideo", "EncodingStats", "Stream", "VideoQA", "make_policy"]
