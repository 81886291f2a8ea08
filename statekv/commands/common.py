"""Options and helpers shared by the video sub-commands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_model_options(parser: argparse.ArgumentParser, *, model_required: bool = True, reserve: bool = True,
                      device_help: str = "e.g. cuda, cuda:1, cpu (default: cuda if available)"):
    """--model and the method settings every video command takes; returns the argument group.

    reserve: offer --reserve-tokens (commands that size the room for questions themselves do not).
    """
    group = parser.add_argument_group("model and method")
    group.add_argument("--model", required=model_required, metavar="M",
                       help="checkpoint folder or hub id (InternVL3 -hf, Qwen3-VL, Eagle2.5)")
    group.add_argument("--method", choices=("statekv", "full", "recency"), default="statekv",
                       help="carry rule (default: statekv)")
    group.add_argument("--budget", type=positive_int, default=4096, metavar="B",
                       help="StateKV: tokens carried per layer and KV head (default: 4096)")
    group.add_argument("--frames", type=positive_int, default=16, metavar="R",
                       help="recency: frames carried (default: 16)")
    group.add_argument("--layout", default=None, help="prompt layout of the model family (default: the paper's)")
    group.add_argument("--attention", choices=("auto", "eager", "chunked", "triton"), default="auto",
                       help="scoring backend (default: auto = triton on CUDA, chunked on CPU)")
    group.add_argument("--dtype", default=None, help="e.g. bfloat16, float32 (default: the checkpoint's)")
    group.add_argument("--device", default=None, help=device_help)
    group.add_argument("--offload", action="store_true",
                       help="keep the detailed cache in CPU memory while encoding")
    group.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                       help="run every streaming step eagerly (default on CUDA: replay steady steps from a graph)")
    group.add_argument("--vision-batch", type=positive_int, default=None, metavar="N",
                       help="frames per vision-tower call, run ahead of the language model (default: 16 on CUDA, "
                            "4 on CPU; statekv stream: 1, each frame encoded as it arrives)")
    if reserve:
        group.add_argument("--reserve-tokens", type=positive_int, default=1024, metavar="N",
                           help="tokens kept after the video for question and answer (default: 1024)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="allow checkpoints that ship their own modelling code (Eagle2.5)")
    return group


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("frame sampling")
    group.add_argument("--max-fps", type=positive_float, default=1.0, metavar="F",
                       help="at most F frames per second of video (default: 1)")
    group.add_argument("--max-frames", type=positive_int, default=512, metavar="N",
                       help="at most N frames in all (default: 512)")


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="K",
                        help="longest answer in tokens (default: 128)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def interactive() -> bool:
    """Progress bars only when a person watches stderr."""
    return sys.stderr.isatty()


def quiet_libraries() -> None:
    """Keep transformers' loading bars and advice out of the output unless stderr is a terminal."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    if not interactive():
        logging.disable_progress_bar()


def load_qa(args: argparse.Namespace):
    """The `VideoQA` the options describe."""
    import statekv

    quiet_libraries()
    return statekv.VideoQA.from_pretrained(
        args.model, method=args.method, budget=args.budget, frames=args.frames, layout=args.layout,
        attention=args.attention, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code,
        reserve_tokens=args.reserve_tokens, offload=args.offload, cuda_graph=args.cuda_graph,
        vision_batch=args.vision_batch,
    )


def describe_method(args: argparse.Namespace) -> str:
    return {"statekv": f"statekv B={args.budget}", "recency": f"recency R={args.frames}", "full": "full"}[args.method]


def print_json(document: Any) -> None:
    print(json.dumps(document, indent=2))
