"""Stress check (not collected by pytest): ``statekv stream`` stopped by SIGTERM or SIGHUP at a random moment,
many times in a row, with CPU burners loading the machine. Every run must exit with 128 + the signal's number,
say it stopped on its last line, and leave a saved stream that loads and equals, tensor for tensor, the stream
of the frames it took (re-streamed here, never stopped).

    python tests/stress_signals.py --runs 30 --burners 2      # from the repository root

Prints one line per run and a last line ``N of N runs stopped between whole pushes``; exits 1 if any did not.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _burn(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--burners", type=int, default=2, help="CPU-bound processes running meanwhile")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds a run may take")
    args = parser.parse_args()

    import statekv
    from statekv.testing import make_tiny_checkpoint, write_test_video
    from test_hostile_runs import _equal_states, _restreamed

    folder = Path(tempfile.mkdtemp(prefix="statekv-signal-stress-"))
    video = write_test_video(folder / "long.mp4", frames=600, fps=4)  # 150 frames at 1 fps
    model = make_tiny_checkpoint("internvl", folder / "model")
    qa = statekv.VideoQA.from_pretrained(model, budget=20, attention="eager")
    burners = [multiprocessing.Process(target=_burn, args=(time.time() + 24 * 3600,), daemon=True)
               for _ in range(args.burners)]
    for burner in burners:
        burner.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    good, rng = 0, random.Random()
    try:
        for run in range(args.runs):
            name = ("SIGTERM", "SIGHUP")[run % 2]
            number = getattr(signal, name)
            saved = folder / f"kept-{run}.safetensors"
            child = subprocess.Popen(
                [sys.executable, "-m", "statekv.cli", "stream", str(video), "--model", str(model), "--budget", "20",
                 "--attention", "eager", "--json", "--ask", "1:What?", "--ask", "149:And now?", "--save", str(saved)],
                cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline, lines = time.monotonic() + args.timeout, []
            while time.monotonic() < deadline:
                line = child.stdout.readline()
                if not line:
                    break
                lines.append(line)
                if '"event": "answer"' in line:
                    time.sleep(rng.uniform(0.0, 1.5))  # somewhere among the pushes that follow
                    child.send_signal(number)
                    break
            try:
                out, err = child.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                print(f"run {run} {name}: did not stop", flush=True)
                continue
            problem = None
            last = err.strip().splitlines()[-1] if err.strip() else ""
            if child.returncode != 128 + number or last != f"statekv stream: stopped by {name}":
                problem = f"exit {child.returncode}, last line {last!r}"
            else:
                summary = json.loads(("".join(lines) + out).strip().splitlines()[-1])
                try:
                    with statekv.Stream.load(saved, qa) as resumed:
                        if resumed.frames != summary["stats"]["frames"]:
                            problem = f"{resumed.frames} frames saved, the summary says {summary['stats']['frames']}"
                        elif not _equal_states(resumed, _restreamed(qa, video, resumed.frames)):
                            problem = f"the {resumed.frames} frames saved differ from the stream of those frames"
                        frames = resumed.frames
                except statekv.errors.StateKVError as error:
                    problem = f"the saved stream does not load: {error}"
            good += problem is None
            print(f"run {run} {name}: " + (problem or f"stopped after {frames} frames, saved whole"), flush=True)
    finally:
        for burner in burners:
            burner.terminate()
    print(f"{good} of {args.runs} runs stopped between whole pushes")
    return 0 if good == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
