"""Where a method's frames lose an answer: the same videos streamed by two methods, each question asked from its
evidence frames alone under both, then method A's context with one layer's (or one kind of token's) keys and
values taken from method B's.

Every video of a set is pushed, every frame, into a `VideoQA.stream()` of each method (bounded positions, the
defaults); a question's context is what the engine reads for it (`AnswerCache`, its evidence frames forced in and
nothing else, laid out as the engine lays them out), captured after the prompt's forward. Both methods stream the
same tokens, so their contexts hold the same tokens at the same places; only what each frame computed differs.
Each question is then answered by the model's own forward over a context (transformers' `DynamicCache`):

* ``a``, ``b``: each method's own context (each checked against the engine's answer: ``a_agrees``, ``b_agrees``);
* ``a+b.L<i>``: A's context with layer ``i``'s keys and values from B's (``b+a.L<i>``: the other way round);
* ``a+b.<kind>``: A's with B's keys and values at every layer for one kind of token of each frame: ``visual`` (the
  frame's visual token), ``img_end`` (its ``</img>``), ``anchor`` (its ``Frame{i}:`` text);
* ``a+b.L<i>.visual``: at layer ``i`` alone, the visual tokens' keys and values (``.keys`` / ``.values``: either
  alone);
* ``a+b.visual.past`` / ``.inside``: B's visual tokens at every layer for the frames whose step ends past the
  positions the model declares / inside them alone (``a+b.L<i>.visual.past`` / ``.inside``: at layer ``i``): does
  a question need its frames repaired, or the frames it compares written alike?

The built-in model's frames (one visual token each) only: a checkpoint with more visual tokens a frame is refused.

    python benchmarks/context_swap.py --set long=data/dev-2400,4904,12,2400 --runs runs/context_swap

One JSON line per video in ``RUNS/<set>-<A>-<B>.json`` (a rerun resumes at the next video; a file of another
checkpoint or set is refused); ``--out`` writes the table of every set given into its ``### Runs of
benchmarks/context_swap.py`` section (appended at the end if absent).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from past_range import METHODS, DataSet, evidence_steps, push_video, retrievals  # noqa: E402

KINDS = ("visual", "img_end", "anchor")
FAMILIES = ("needle", "attribute", "order", "first_last")
NOT_CONTEXTS = ("qid", "family", "evidence", "a_agrees", "b_agrees")


@dataclass
class Context:
    """A question's context as the engine read it: per layer ``(keys [1, H_kv, C, D] placed, values, tokens [C])``
    (``tokens``: indices in the detailed cache), the prompt's ids ``[Q]`` and the position it starts at."""

    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ids: torch.Tensor
    start: int


def capture(stream, prompt_text: str, evidence: list[int]) -> tuple[Context, int]:
    """The context ``stream`` reads for ``prompt_text`` from the ``evidence`` steps alone, and the token the engine
    answers with first."""
    from statekv.core.answering.answer_cache import AnswerCache
    from statekv.core.attention.switch import share_language_attention

    _, Forced = retrievals()
    base = stream.retrieval(16)
    prompt, _ = stream.laid_out_question(prompt_text, 2, 16, None)
    forced = Forced(16, base.keep_tokens, base.rule, forced=tuple(evidence), fill=False)
    prompt, retrieve, plan = stream.prefill.check_question(prompt, forced, {"max_new_tokens": 2})
    ids = prompt.input_ids
    cache = AnswerCache(stream.prefill.cache, ids.shape[1] + 2, stream.prefill.device, retrieve, plan)
    model = stream.qa.adapter.model
    share_language_attention(model)
    with torch.no_grad(), stream.prefill.streaming(cache):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True,
                       attention_mask=torch.ones(1, plan.start + ids.shape[1], dtype=torch.long)).logits
    layers = [(layer.keys[:, :, :layer.context].clone(), layer.values[:, :, :layer.context].clone(),
               layer.retrieved.clone()) for layer in cache.layers]
    return Context(layers, ids[0], plan.start), int(logits[0, -1].argmax())


def answer(model, context: Context) -> int:
    """The first token the model's own forward gives after ``context`` (eager attention, no engine)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for index, (keys, values, _) in enumerate(context.layers):
        cache.update(keys, values, index)
    positions = context.start + torch.arange(context.ids.shape[0])
    with torch.no_grad():
        logits = model(input_ids=context.ids[None], past_key_values=cache, position_ids=positions[None]).logits
    return int(logits[0, -1].argmax())


def token_kinds(tokens: torch.Tensor, starts: torch.Tensor, limit: int | None = None) -> dict[str, torch.Tensor]:
    """``[C]`` masks of which context tokens are each frame's visual token, ``</img>`` and anchor text (a frame's
    step ends ``... <img> <IMG_CONTEXT> </img>``; ``starts`` ``[S + 1]``: each step's first token, then the end);
    the prompt prefix is none of them. With ``limit`` (the positions the model declares), ``visual.past`` and
    ``visual.inside``: the visual tokens of the frames whose step ends past it, or inside it."""
    step = torch.searchsorted(starts, tokens, right=True) - 1
    from_end = starts[1:][step] - tokens
    frame = step > 0
    kinds = {"visual": frame & (from_end == 2), "img_end": frame & (from_end == 1), "anchor": frame & (from_end > 3)}
    if limit is not None:
        past = starts[1:][step] > limit
        kinds.update({"visual.past": kinds["visual"] & past, "visual.inside": kinds["visual"] & ~past})
    return kinds


def mixed(a: Context, b: Context, layers: range | list[int], kind: str | None = None,
          parts: tuple[str, ...] = ("keys", "values"), starts: torch.Tensor | None = None,
          limit: int | None = None) -> Context:
    """``a`` with ``b``'s keys and/or values at ``layers``, at the tokens of ``kind`` (`token_kinds`, with the
    steps' first tokens ``starts`` and the model's ``limit``; None: every token)."""
    if kind is not None and starts is None:
        raise ValueError("a swap of one kind of token needs the steps' first tokens (starts)")
    swapped = []
    for index, ((keys, values, tokens), (b_keys, b_values, _)) in enumerate(zip(a.layers, b.layers)):
        if index in layers:
            keys, values = keys.clone(), values.clone()
            chosen = slice(None) if kind is None else token_kinds(tokens, starts, limit)[kind]
            if "keys" in parts:
                keys[:, :, chosen] = b_keys[:, :, chosen]
            if "values" in parts:
                values[:, :, chosen] = b_values[:, :, chosen]
        swapped.append((keys, values, tokens))
    return Context(swapped, a.ids, a.start)


def swaps(a: Context, b: Context, starts: torch.Tensor, limit: int) -> dict[str, Context]:
    """Every context the module docstring names, by name (``limit``: the positions the model declares)."""
    depth = len(a.layers)
    out = {"a": a, "b": b}
    for layer in range(depth):
        out[f"a+b.L{layer}"] = mixed(a, b, [layer])
        out[f"b+a.L{layer}"] = mixed(b, a, [layer])
    for kind in KINDS:
        out[f"a+b.{kind}"] = mixed(a, b, range(depth), kind, starts=starts)
    for layer in range(depth):
        out[f"a+b.L{layer}.visual"] = mixed(a, b, [layer], "visual", starts=starts)
        for part in ("keys", "values"):
            out[f"a+b.L{layer}.visual.{part}"] = mixed(a, b, [layer], "visual", (part,), starts)
    for place in ("past", "inside"):
        out[f"a+b.visual.{place}"] = mixed(a, b, range(depth), f"visual.{place}", starts=starts, limit=limit)
        for layer in range(depth):
            out[f"a+b.L{layer}.visual.{place}"] = mixed(a, b, [layer], f"visual.{place}", starts=starts, limit=limit)
    return out


def same_reading(a: Context, b: Context) -> bool:
    """Whether two contexts hold the same tokens at the same places (what a swap needs)."""
    return a.start == b.start and torch.equal(a.ids, b.ids) and all(
        torch.equal(x[2], y[2]) and x[0].shape == y[0].shape for x, y in zip(a.layers, b.layers))


def run_video(streams: dict, model, questions, evidence_of: dict, letters: dict) -> list[dict]:
    from statekv.eval.prompts import build_prompt

    (a_stream, stills), (b_stream, _) = streams.values()
    starts = a_stream.prefill.cache.step_starts()
    limit = a_stream.qa.adapter.model.config.get_text_config().max_position_embeddings
    rows = []
    for question in questions:
        if question.task_type not in FAMILIES:
            continue
        prompt, evidence = build_prompt(question), evidence_steps(stills, evidence_of[question.qid])
        (a, a_engine), (b, b_engine) = capture(a_stream, prompt, evidence), capture(b_stream, prompt, evidence)
        if not same_reading(a, b):
            raise SystemExit(f"{question.qid}: the two methods' contexts hold different tokens; nothing to swap")
        right = letters[question.answer]
        answers = {name: answer(model, context) for name, context in swaps(a, b, starts, limit).items()}
        rows.append({"qid": question.qid, "family": question.task_type, "evidence": evidence,
                     "a_agrees": answers["a"] == a_engine, "b_agrees": answers["b"] == b_engine,
                     **{name: token == right for name, token in answers.items()}})
    return rows


def read_run(path: Path) -> tuple[list[dict], bool]:
    """The videos a run file holds, and whether a line was damaged (cut short by a stop: left out, its video is
    done again)."""
    videos, damaged = [], False
    for line in path.read_text().splitlines() if path.exists() else []:
        if not line.strip():
            continue
        try:
            videos.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"{path}: skipping a damaged line", file=sys.stderr)
            damaged = True
    return videos, damaged


def run(dataset: DataSet, methods: tuple[str, str], checkpoint: str, out: Path) -> None:
    from itertools import groupby

    import statekv
    from statekv.eval.loaders import load_synthetic
    from transformers import InternVLForConditionalGeneration

    videos, damaged = read_run(out)
    identity = {"checkpoint": checkpoint, "set": [str(dataset.folder.resolve()), dataset.seed, dataset.frames]}
    if any(video.get(key) != value for video in videos for key, value in identity.items()):
        raise SystemExit(f"{out} holds videos of another checkpoint or set; use another --runs folder")
    if damaged:  # drop the damaged line before appending, atomically: no finished video is ever lost
        temporary = out.with_suffix(".tmp")
        temporary.write_text("".join(json.dumps(video) + "\n" for video in videos))
        os.replace(temporary, out)
    done = {video["video"] for video in videos}
    evidence_of = {row["qid"]: row["evidence_frames"] for row in map(json.loads, (
        dataset.folder / "questions.jsonl").read_text().splitlines())}
    qas = {method: statekv.VideoQA.from_pretrained(checkpoint, device="cpu", positions="bounded", **METHODS[method])
           for method in methods}
    config = qas[methods[0]].adapter.model.config
    if getattr(config, "image_seq_length", 1) != 1:
        raise SystemExit(f"{checkpoint}: {config.image_seq_length} visual tokens a frame; the swaps name one (the "
                         "built-in model's)")
    folder = qas[methods[0]].adapter.model.name_or_path
    model = InternVLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    tokenizer = qas[methods[0]].adapter.tokenizer
    letters = {letter: tokenizer.convert_tokens_to_ids(letter) for letter in "ABCD"}
    for video, group in groupby(load_synthetic(dataset.folder), key=lambda q: q.video_id):
        if video in done:
            continue
        questions = list(group)
        started = time.monotonic()
        streams = {method: push_video(qa, questions[0].video_path)[:2] for method, qa in qas.items()}
        rows = run_video(streams, model, questions, evidence_of, letters)
        for stream, _ in streams.values():
            stream.close()
        with out.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"video": video, "methods": list(methods), **identity, "questions": rows}) + "\n")
        print(f"{out.stem} {video}: {len(rows)} questions, {time.monotonic() - started:.0f} s", file=sys.stderr,
              flush=True)


def table(runs: dict[str, list[dict]]) -> str:
    """Correct / asked per context (rows) and set (columns), with the order and first_last families apart."""
    names, lines, columns = {}, [], []
    for name, videos in runs.items():
        rows = [row for video in videos for row in video["questions"]]
        if not rows:
            continue
        names.update({key: None for row in rows for key in row if key not in NOT_CONTEXTS})
        methods = videos[0]["methods"]
        timed = [row for row in rows if row["family"] in ("order", "first_last")]
        columns.append((f"{name}: {methods[0]} (a) / {methods[1]} (b), all", rows))
        columns.append((f"{name}: order and first_last", timed))
        agrees = [sum(row[key] for row in rows) for key in ("a_agrees", "b_agrees")]
        lines.append(f"{name}: the model's own forward over `a` and over `b` gives the engine's answer for "
                     f"{agrees[0]} and {agrees[1]} of {len(rows)}.")
    if not columns:
        return "No runs yet."
    header = "| context | " + " | ".join(label for label, _ in columns) + " |"
    rule = "|---|" + "---:|" * len(columns)
    def cell(key, rows):
        return f"{sum(row[key] for row in rows)}/{len(rows)}" if all(key in row for row in rows) else "–"

    body = [f"| `{key}` | " + " | ".join(cell(key, rows) for _, rows in columns) + " |" for key in names]
    return "\n".join([header, rule, *body, "", *lines])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", type=DataSet.parse, required=True, dest="sets",
                        metavar="NAME=DIR,SEED,VIDEOS,FRAMES", help="a set (made if missing)")
    parser.add_argument("--methods", default="full,statekv", help="A,B: A's contexts take B's keys and values")
    parser.add_argument("--checkpoint", default="builtin", help="a checkpoint folder (default: the built-in model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=Path, default=Path("runs/context_swap"))
    parser.add_argument("--out", type=Path, help="markdown file to write the table into (its own section)")
    args = parser.parse_args(argv)
    methods = tuple(args.methods.split(","))
    if len(methods) != 2 or methods[0] == methods[1] or any(method not in METHODS for method in methods):
        parser.error(f"--methods takes two different methods of {', '.join(METHODS)}, got {args.methods!r}")
    torch.set_num_threads(args.threads)
    args.runs.mkdir(parents=True, exist_ok=True)
    paths = {dataset.name: args.runs / f"{dataset.name}-{methods[0]}-{methods[1]}.json" for dataset in args.sets}
    for dataset in args.sets:
        dataset.make()
        run(dataset, methods, args.checkpoint, paths[dataset.name])
    runs = {name: read_run(path)[0] for name, path in paths.items()}
    text = table(runs)
    print(text)
    if args.out:
        from report import write_section

        command = "python benchmarks/context_swap.py " + shlex.join(argv if argv is not None else sys.argv[1:])
        note = (f"Command: `{command}`  \nMachine: {platform.machine()}, {args.threads} torch thread, "
                f"{os.cpu_count()} cores shared with other work.")
        write_section(args.out, "Runs of benchmarks/context_swap.py", f"{note}\n\n{text}", level=3)


if __name__ == "__main__":
    main()
