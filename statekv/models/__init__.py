"""Model-family adapters: frames + text -> streaming chunks, and the prompt a question decodes from after them."""

from .base import Chunk, LayoutState, PreparedFrames, VideoAdapter, VisualFeatures
from .registry import adapter_for, checkpoint_model_type, load_adapter, register_adapter, supported_model_types

__all__ = [
    "Chunk", "InternVLAdapter", "LayoutState", "PreparedFrames", "Qwen3VLAdapter", "RemoteInternVLAdapter", "VideoAdapter",
    "VisualFeatures", "adapter_for", "checkpoint_model_type", "load_adapter", "register_adapter", "supported_model_types",
]

# Importing a family module registers its adapter.
from .internvl import InternVLAdapter  # noqa: E402
from .qwen3_vl import Qwen3VLAdapter  # noqa: E402
from .remote_internvl import RemoteInternVLAdapter  # noqa: E402
