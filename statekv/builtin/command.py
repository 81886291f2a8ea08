"""``statekv train-builtin``: train the built-in model from scratch on CPU (resumable), optionally install it.

    statekv train-builtin --out runs/builtin             # rerun the same command to resume after a stop
    statekv train-builtin --out runs/builtin --install   # then copy the weights into the package
    statekv train-builtin --out runs/long --init W       # the long-range phase alone, from the curriculum's weights W
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from statekv.settings.values import PATH, POSITIVE_INT

    parser = subparsers.add_parser(
        "train-builtin", help="train the built-in model on synthetic videos (CPU, resumable)",
        description="Train the built-in InternVL3 model from scratch on synthetic videos with full attention, "
                    "following the recipe in statekv.builtin.training (seeded). Writes log.jsonl, "
                    "checkpoint.pt, model/ and loss.png to --out; rerun the same command to resume.")
    parser.add_argument("--out", required=True, type=PATH, help="run folder (log, checkpoint, final model)")
    parser.add_argument("--threads", type=POSITIVE_INT, metavar="T",
                        help="CPU threads (default: OMP_NUM_THREADS when set, else 2)")
    parser.add_argument("--stop-after", type=POSITIVE_INT, metavar="STEPS",
                        help="stop once this many steps are done (rerun to go on)")
    parser.add_argument("--init", type=PATH, metavar="FOLDER",
                        help="a checkpoint folder holding the weights the curriculum ends with (the built-in model "
                             "before its long-range phase): train the long-range phase alone from them")
    parser.add_argument("--install", action="store_true",
                        help="when training is complete, copy model/ into the package as the built-in model")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from statekv.builtin.install import install_weights
    from statekv.builtin.plots import plot_log
    from statekv.builtin.training import (LOG_FILE, MODEL_DIR, PREVIOUS_STATE_FILE, STATE_FILE, Recipe, run_field,
                                          train, trained_steps)

    from statekv.console import omp_threads, quiet_libraries
    from statekv.errors import ConfigurationError
    from statekv.settings.values import check_output_dir, check_output_file

    cores = os.cpu_count() or 1
    threads = args.threads or min(omp_threads() or 2, cores)
    if threads > cores:  # each thread holds its own buffers: far more threads than cores exhausts memory
        raise ConfigurationError(f"--threads {threads} is more than this machine's {cores} CPU cores")
    check_output_dir(args.out, "--out")
    for name in (LOG_FILE, "loss.png", STATE_FILE, PREVIOUS_STATE_FILE, STATE_FILE + ".tmp"):
        check_output_file(args.out / name, "--out")  # a folder of that name in it, say: refused before training
    if (args.out / MODEL_DIR).exists() and not (args.out / MODEL_DIR).is_dir():
        raise ConfigurationError(f"--out {args.out}: {args.out / MODEL_DIR} is a file where the trained model's "
                                 "folder goes")
    recipe = Recipe()
    if args.init is not None and args.stop_after is not None and args.stop_after <= recipe.curriculum_steps:
        raise ConfigurationError(f"--stop-after {args.stop_after}: a run from --init starts at step "
                                 f"{recipe.curriculum_steps} (the curriculum's steps are in its weights); give more")
    if args.init is not None and trained_steps(args.out) and run_field(args.out, "init") != str(args.init.resolve()):
        raise ConfigurationError(f"--init {args.init}: {args.out} holds a run already (step "
                                 f"{trained_steps(args.out)}) whose checkpoint does not name these weights as its "
                                 "start; give a new --out for a phase from them, or rerun without --init to go on")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    quiet_libraries()  # --init's weights load without transformers' bar in a log
    model_dir = train(recipe, args.out, threads=threads, stop_after=args.stop_after, init=args.init)
    if (args.out / LOG_FILE).is_file():
        plot_log(args.out / LOG_FILE, args.out / "loss.png")
    if trained_steps(args.out) < recipe.steps or not model_dir.is_dir():  # a model/ there may be an earlier run's
        print(f"stopped at step {trained_steps(args.out)} of {recipe.steps}; rerun to go on")
        return 0
    print(f"wrote {model_dir}" + (f" and {args.out / 'loss.png'}" if (args.out / "loss.png").is_file() else ""))
    if args.install:
        print(f"installed the weights in {install_weights(model_dir)}")
    return 0
