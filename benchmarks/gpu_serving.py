"""The GPU suite's serving sections (`gpu_suite.py` runs them): time to first token against the frames a stream has
seen, and the most live 1-fps cameras an 8B model holds on one device.

* ``TTFT``: a random decoder of the model's language shape (the vision tower plays no part in answering) streams
  frames of ``ttft_frame_tokens`` tokens (a small frame: 16 tokens, not a real frame's 256, so 4,096 frames fit the
  section's time) under StateKV, one frame per step up to 256 frames, then 16 frames per step; at 16, 64, 256 and
  4,096 frames a question of ``ttft_prompt_tokens`` tokens is asked from the whole detailed cache, and the time from
  asking to the first answer token (``StreamingPrefill.generate`` with one new token) is the median of three asks
  after one warm-up ask.
* ``live streams``: a random InternVL3-8B (the 1B checkpoint's vision tower and tokenizer, the 8B's decoder shape)
  built in device memory, served by ``statekv serve``'s application on a thread (`statekv.bench.server.
  InProcessServer`), and loaded by ``statekv bench serve --url ... --find-max`` in its own process: 1-fps cameras
  of 448x448 frames, each live for 16 frames before a run's clock starts (its carried state of 4,096 tokens full),
  questions at 0.2 per second per camera, p95 TTFT at most 0.5 s, runs of 6 s; the search starts at 8 cameras,
  stops at the section's cap and says whether it finished.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_measure import synchronize

ROOT = Path(__file__).resolve().parents[1]
TTFT_TARGET_S = 0.5


def decoder(lm: dict, tokens: int, device: str):
    """A random Qwen2 decoder of the shape ``lm`` (Qwen2Config fields) whose RoPE covers ``tokens``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    config = Qwen2Config(**{**lm, "max_position_embeddings": tokens})
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def ttft(section, deadline: float, model, shapes, label: str, profile=None) -> None:
    """Time to first token at each of ``shapes.ttft_frames`` frames seen, on ``model`` (see the module doc);
    ``profile(device, run, steps)``, where given, adds what one more ask launched, copied and synced to each row."""
    import statekv
    import torch

    device, tokens, lengths = shapes.device, shapes.ttft_frame_tokens, shapes.ttft_frames
    group_after, group = shapes.ttft_group_after, shapes.ttft_group
    hidden = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    generator = torch.Generator(device=device).manual_seed(1)
    chunks = {count: [0.02 * torch.randn(1, count * tokens, hidden, device=device, dtype=dtype, generator=generator)
                      for _ in range(4)] for count in (1, group)}
    prompt = torch.randint(3, min(model.config.vocab_size, 1000), (1, shapes.ttft_prompt_tokens),
                           generator=torch.Generator().manual_seed(2)).to(device)
    section.figures["frame_tokens"] = tokens
    horizon = lengths[-1] * tokens + shapes.ttft_prompt_tokens + 8
    with torch.no_grad(), statekv.StreamingPrefill(model, statekv.StateKV(budget=shapes.ttft_budget),
                                                   horizon=horizon) as prefill:
        seen, warmed, step = 0, False, 0
        for target in lengths:
            while seen < target and time.monotonic() < deadline:
                count = group if seen >= group_after and target - seen >= group else 1
                prefill.step(inputs_embeds=chunks[count][step % 4])
                seen, step = seen + count, step + 1
            if seen < target:
                section.rows.append({"model": label, "frames": target, "error": "not reached: the section's time "
                                     f"cap came at {seen} frames"})
                continue
            if not warmed:
                prefill.generate(prompt, max_new_tokens=1)
                warmed = True
            times = []
            for _ in range(3):
                synchronize(device)
                started = time.perf_counter()
                prefill.generate(prompt, max_new_tokens=1)
                synchronize(device)
                times.append(time.perf_counter() - started)
            section.rows.append({"model": label, "frames": target, "tokens_seen": prefill.seen_tokens,
                                 "steps": step, "ttft_ms": 1e3 * statistics.median(times),
                                 "ttft_ms_min": 1e3 * min(times)})
            if profile is not None:
                section.rows[-1].update(profile(device, lambda: prefill.generate(prompt, max_new_tokens=1), 1))
            print(f"   {section.rows[-1]}", flush=True)
    measured = {row["frames"]: round(row["ttft_ms"], 2) for row in section.rows if "ttft_ms" in row}
    if measured:
        section.figures[f"ttft_ms_{label}"] = measured


def live_model(shapes, checkpoint: Path):
    """The VideoQA of the live-stream section: InternVL3-8B's decoder shape (a smoke run's: the small one) with the
    1B checkpoint's vision tower and tokenizer, built in device memory (random weights)."""
    import statekv
    import torch
    from statekv.models.internvl import InternVLAdapter
    from statekv.settings.options import ModelOptions

    cuda = shapes.device.startswith("cuda")
    options = ModelOptions(model="random InternVL3-8B", method="statekv", budget=shapes.budget,
                           dtype="bfloat16" if cuda else "float32", device=shapes.device)
    model, tokenizer, image_size = vlm_in_memory(checkpoint, shapes.lm, shapes.device,
                                                 torch.bfloat16 if cuda else torch.float32)
    answer_in_text(model, tokenizer)
    return statekv.VideoQA.with_adapter(InternVLAdapter(model, tokenizer, image_size=image_size), options)


def answer_in_text(model, tokenizer) -> None:
    """Zero the output rows of every token that does not decode, alone, to printable ASCII: a random model's
    greedy answer then streams text from its first token. Else its tokens (ids past the small tokenizer's
    vocabulary, special tokens, bytes of a partial UTF-8 character) decode to nothing, the server streams no
    piece until the answer ends, and a client's time to first token is the whole answer's. A zero row scores 0,
    below the best of the kept rows' random scores."""
    import torch

    kept = [token for token in range(len(tokenizer))
            if (text := tokenizer.decode([token], skip_special_tokens=True)).strip()
            and text.isascii() and text.isprintable()]
    head = model.get_output_embeddings().weight
    dropped = torch.ones(head.shape[0], dtype=torch.bool)
    dropped[kept] = False
    with torch.no_grad():
        head[dropped.to(head.device)] = 0


def vlm_in_memory(checkpoint: Path, lm: dict, device: str, dtype):
    """``(model, tokenizer, image side)``: the InternVL of ``checkpoint`` (its vision tower, projector layout and
    tokenizer) with a decoder of the shape ``lm`` (Qwen2Config fields), random, built on ``device``."""
    import torch
    from statekv.models.checkpoint_files import square_side
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    config = AutoConfig.from_pretrained(checkpoint)
    text = {key: value for key, value in config.text_config.to_dict().items() if key != "layer_types"}
    vocabulary = max(text["vocab_size"], lm.get("vocab_size", 0))  # the tokenizer's ids stay inside it
    text.update({key: value for key, value in lm.items() if key != "rope_parameters"}, max_position_embeddings=32768,
                vocab_size=vocabulary)
    config.text_config = type(config.text_config)(**text)  # made again: per-layer fields follow the layer count
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(checkpoint), square_side(config.vision_config.image_size)


def live_streams(section, deadline: float, shapes, checkpoint: Path, folder: Path) -> None:
    """The most live 1-fps cameras held with p95 TTFT <= 0.5 s (see the module doc)."""
    from statekv.bench.server import InProcessServer

    qa = live_model(shapes, checkpoint)
    out = folder / "live.json"
    with InProcessServer(qa) as server:
        left = deadline - time.monotonic()
        command = [sys.executable, "-m", "statekv.cli", "bench", "serve", "--url", server.url, "--api-key",
                   server.key, "--find-max", "--streams", str(shapes.live_start), "--fps", "1", "--duration",
                   str(shapes.live_duration), "--drain", str(shapes.live_duration), "--question-rate", "0.2",
                   "--warm-frames", str(shapes.live_warm_frames), "--max-streams", str(shapes.live_max),
                   "--max-new-tokens", "4", "--frame-size", str(shapes.image_size), "--ttft-target",
                   str(TTFT_TARGET_S), "--time-limit", str(max(1.0, left - 15)), "--json", str(out), "--quiet"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=max(10.0, left))
    if result.returncode != 0:
        raise RuntimeError(f"statekv bench serve exited {result.returncode}: {result.stderr.strip()[-300:]}")
    document = json.loads(out.read_text())
    for row in document["results"]:
        section.rows.append({name: row[name] for name in (
            "streams", "frames_per_s", "lag_p95_s", "questions", "answers", "ttft_p50_s", "ttft_p95_s",
            "server_ttft_mean_s", "goodput_streams", "failures", "mean_batch", "errors")})
        print(f"   {section.rows[-1]}", flush=True)
    section.figures["live_streams_8b"] = document["max_streams_held"]
    section.figures["live_search_complete"] = document["search_complete"]
    section.figures["live_search_capped"] = document["search_capped"]  # every count to --max-streams held


def ttft_lm(shapes) -> dict[str, Any]:
    """The 1B's decoder shape for the TTFT section (its checkpoint's text config, the real vocabulary)."""
    if shapes.vlm_text is None:
        return dict(shapes.lm)
    text = {key: value for key, value in shapes.vlm_text.items() if key != "max_position_embeddings"}
    return {**text, "vocab_size": shapes.lm["vocab_size"], "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
