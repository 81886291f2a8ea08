"""Video input: open a source, sample frames lazily, preprocess them per model family.

    video = open_video("clip.mp4")                 # or a folder, PIL images, array [N, H, W, 3]
    video.num_frames, video.fps, video.duration
    for frame in video.sample(max_fps=1, max_frames=512):   # Frame(index, timestamp, image RGB uint8 [H, W, 3])
        ...
"""

from ..errors import FrameDecodeError, VideoError, VideoNotFoundError
from .preprocess import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    QWEN_MEAN,
    QWEN_STD,
    internvl_pixel_values,
    qwen_frame_size,
    qwen_pixel_values,
    temporal_groups,
)
from .images import ImageError, decode_image
from .sampling import num_sampled_frames, sample_at_rate, source_frame_indices, uniform_frame_indices
from .sources import DEFAULT_IMAGE_FPS, FileVideo, Frame, ImageSequenceVideo, Video, open_video

__all__ = [
    "DEFAULT_IMAGE_FPS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageError",
    "QWEN_MEAN",
    "QWEN_STD",
    "FileVideo",
    "FrameDecodeError",
    "Frame",
    "ImageSequenceVideo",
    "Video",
    "VideoError",
    "VideoNotFoundError",
    "decode_image",
    "internvl_pixel_values",
    "num_sampled_frames",
    "open_video",
    "qwen_frame_size",
    "qwen_pixel_values",
    "sample_at_rate",
    "source_frame_indices",
    "temporal_groups",
    "uniform_frame_indices",
]
