"""The docs run: every command and code block of docs/serving.md, in order, against a real server with the
built-in model, and README.md's commands (each parsed by the CLI's own parser; those that need no download run).

docs/serving.md becomes one bash script: bash blocks as written (``statekv`` and ``python`` are this
checkout's), python blocks as files run where they stand, ``statekv serve`` started in the background until it
is ready (stopped before the next one), a comment line right after a command checked against its output (JSON
compared as JSON). Only four things are not run as written: port 8000 becomes a free port, ``pip install``
(what it installs is checked here instead), a ``statekv serve`` of a checkpoint that must be downloaded (parsed
with the CLI's own parser instead), and the blocks for a cluster of several machines (``ray start``, ``serve run``,
``statekv serve --ray``: each command parsed by its own CLI, Ray's or statekv's; tests/test_serve_ray.py runs
``statekv serve --ray`` on a local cluster, and tests/test_serve_cluster.py builds the Serve config file, the
yaml block). Text blocks are output the server must print.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVING = REPO / "docs" / "serving.md"
README = REPO / "README.md"
HUB_MODEL = re.compile(r"--model\s+(?!builtin\b)\S+/\S+")

pytestmark = pytest.mark.slow


def blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block, in order."""
    return [(match.group(1) or "", match.group(2))
            for match in re.finditer(r"^```(\w*)\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)]


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined."""
    lines, current = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    return lines


def statekv_argv(line: str) -> list[str]:
    """The arguments of a ``statekv ...`` command line (its comment dropped)."""
    return shlex.split(line, comments=True)[1:]


def parse_with_cli(argv: list[str]) -> None:
    from statekv.cli import build_parser
    from statekv.settings.options import normalize_argv

    try:
        build_parser().parse_args(normalize_argv(argv))  # a drifted flag exits here, with status 2
    except SystemExit as exit:
        assert exit.code == 0 and "--help" in argv, f"statekv {shlex.join(argv)}: refused by the CLI"


def parse_with_ray_cli(argv: list[str]) -> None:
    """A ``ray ...`` or ``serve ...`` command, parsed by Ray's own CLI (click): a drifted option raises."""
    import click

    if argv[0] == "ray":
        from ray.scripts.scripts import cli
    else:
        from ray.serve.scripts import cli
    try:
        context = cli.make_context(argv[0], list(argv[1:]))
        name, command, rest = cli.resolve_command(context, list(argv[1:]))
        command.make_context(name, rest, parent=context)
    except click.UsageError as error:
        raise AssertionError(f"{shlex.join(argv)}: refused by Ray's CLI ({error.format_message()})") from None


def cluster_block(text: str) -> bool:
    """A block for a cluster of several machines (Ray's commands, or ``statekv serve --ray``)."""
    return any(line.strip().startswith(("ray ", "serve ")) or re.match(r"\s*statekv serve .*--ray", line)
               for line in logical_lines(text))


def check_cluster_block(text: str, parsed: list[list[str]]) -> None:
    """Parse every command of a cluster block: statekv's later with the CLI's parser (``parsed``), Ray's now."""
    for line in logical_lines(text):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("pip install"):
            check_pip_line(stripped)
            continue
        if stripped.startswith("export "):  # only the values it computes with Ray's CLI are checked
            commands = [found for found in re.findall(r"\$\(([^)]*)\)", stripped) if found.startswith("ray ")]
        else:
            commands = [stripped]
        for command in commands:
            argv = shlex.split(command, comments=True)
            argv = argv[:argv.index(">")] if ">" in argv else argv  # where its output goes is the shell's business
            if argv[0] == "statekv":
                parsed.append(argv[1:])
            else:
                assert argv[0] in ("ray", "serve"), f"what runs {command!r} in a cluster block of docs/serving.md?"
                parse_with_ray_cli(argv)


def check_pip_line(line: str) -> None:
    """``pip install ... -e ".[extra]"`` names extras that exist and pins from a constraints file that exists."""
    extras = set(re.findall(r"\.\[([\w,]+)\]", line)[0].split(",")) if "[" in line else set()
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras <= set(declared), line
    if "-c constraints.txt" in line:
        assert (REPO / "constraints.txt").is_file()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


PRELUDE = r"""
set -euo pipefail
statekv() { "$STATEKV_PYTHON" -m statekv.cli "$@"; }
python() { "$STATEKV_PYTHON" "$@"; }
SERVER=""; SERVERS=0
stop_server() { if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; SERVER=""; fi; }
trap stop_server EXIT
serve() {
  stop_server; SERVERS=$((SERVERS + 1)); local log="server-$SERVERS.log"
  shift  # "statekv": the server runs as its own process (not a function in a subshell), so it can be stopped
  "$STATEKV_PYTHON" -m statekv.cli "$@" > "$log" 2>&1 & SERVER=$!
  for _ in $(seq 1500); do
    if grep -q "ready (pid" "$log"; then
      if [ -z "${KEY:-}" ]; then export KEY=$(grep -o 'key=[^ ]*' "$log" | head -1 | cut -d= -f2); fi
      return 0
    fi
    kill -0 "$SERVER" 2>/dev/null || { cat "$log"; return 1; }
    sleep 0.2
  done
  cat "$log"; return 1
}
expect() {  # expect OUTPUT WANTED: JSON compared as JSON, anything else as text
  if [[ "$2" == "{"* || "$2" == "["* ]]; then
    jq -e --argjson want "$2" '. == $want' <<<"$1" >/dev/null || { echo "expected $2, got $1" >&2; return 1; }
  else
    [ "$1" == "$2" ] || { echo "expected $2, got $1" >&2; return 1; }
  fi
}
"""


def serving_script(port: int, folder: Path) -> tuple[str, list[list[str]], list[str]]:
    """docs/serving.md as one bash script; also the commands only parsed and the text blocks to find in logs."""
    parts, parsed, texts = [PRELUDE], [], []
    for index, (language, text) in enumerate(blocks(SERVING)):
        text = text.replace("8000", str(port))
        if language == "python":
            (folder / f"block-{index}.py").write_text(text)
            parts.append(f'python block-{index}.py')
            continue
        if language == "text":
            texts.append(text)
            continue
        if language == "yaml":  # the Serve config file: tests/test_serve_cluster.py builds it
            continue
        assert language == "bash", f"a block of docs/serving.md in {language or 'no language'}: what runs it?"
        if cluster_block(text):
            check_cluster_block(text, parsed)
            continue
        lines = logical_lines(text)
        for position, line in enumerate(lines):
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            if stripped.startswith("pip install"):
                check_pip_line(stripped)
                continue
            if stripped.startswith("statekv serve") and HUB_MODEL.search(stripped):
                parsed.append(statekv_argv(stripped))
                continue
            if stripped.startswith("statekv serve"):
                command = stripped.split("#")[0].strip()
                parts.append(f"serve {command}" + ("" if "--port" in command else f" --port {port}"))
                continue
            wanted = [following.strip()[2:] for following in lines[position + 1:position + 2]
                      if following.strip().startswith("# ")]
            if wanted:
                parts.append(f"out=$({stripped.split(' # ')[0]})\nprintf '%s\\n' \"$out\"\n"
                             f"expect \"$out\" {shlex.quote(wanted[0])}")
            else:
                parts.append(stripped)
    return "\n".join(parts) + "\n", parsed, texts


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("jq") is None,
                    reason="the docs' examples use curl and jq")
def test_every_block_of_the_serving_docs_runs_against_a_real_server(tmp_path):
    port = _free_port()
    script, parsed, texts = serving_script(port, tmp_path)
    for argv in parsed:  # a checkpoint that cannot be downloaded here: its flags at least are the CLI's
        parse_with_cli(argv)
    assert parsed and texts
    (tmp_path / "docs.sh").write_text(script)
    env = {**os.environ, "STATEKV_PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    for name in ("KEY", "STATEKV_API_KEYS", "URL", "ID"):
        env.pop(name, None)
    result = subprocess.run(["bash", "docs.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    printed = (tmp_path / "server-1.log").read_text()
    startup = texts[0]  # what the first start prints, as shown
    for line in startup.strip().splitlines():
        pattern = r"\s+".join(re.escape(word) for word in line.split()).replace(re.escape("Yx3..."), r"\S+")
        assert re.search(pattern, printed), f"the docs show {line!r}; the server printed:\n{printed}"
    assert "Traceback" not in result.stderr


def test_every_statekv_command_in_the_readme_parses_and_the_offline_ones_run(tmp_path):
    commands = [line.strip() for language, text in blocks(README) if language == "bash"
                for line in logical_lines(text) if line.strip().startswith("statekv ")]
    assert any(command.startswith("statekv serve") for command in commands)
    for command in commands:
        parse_with_cli(statekv_argv(command))
    for language, text in blocks(README):
        if language == "python":
            compile(text, "README.md", "exec")  # tests/test_readme_python.py runs them
        if language == "bash":
            for line in logical_lines(text):
                if line.strip().startswith("pip install"):
                    check_pip_line(line.strip())
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo: env\n\t\$\(BIN\)/statekv demo$", makefile, re.MULTILINE)  # `make demo`

    serve = next(command for command in commands if command.startswith("statekv serve"))
    (tmp_path / "videos").mkdir()
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "statekv.cli", *statekv_argv(serve), "--port", str(port)],
                               cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "ready (pid" in line:
                break
        assert any("API key" in line for line in lines), "".join(lines)
        import httpx

        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()["status"] == "ok"
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_the_readmes_builtin_answer_example_runs_as_written_and_answers_its_question(tmp_path):
    """The README's ``statekv answer ... --model builtin`` (and the ``synthetic make`` that makes its video), run by
    bash as written: the built-in model answers the multiple-choice question with the letter the comment shows,
    under its own budget (64) when none is given."""
    lines = [line for language, text in blocks(README) if language == "bash" for line in logical_lines(text)]
    answer = next(line for line in lines if line.startswith("statekv answer") and "--model builtin" in line)
    video = statekv_argv(answer)[1]
    make = next(line for line in lines if line.startswith("statekv synthetic make")
                and video.startswith(statekv_argv(line)[statekv_argv(line).index("--out") + 1]))
    expected = answer.rsplit("#", 1)[1].strip()
    script = (f'statekv() {{ "{sys.executable}" -m statekv.cli "$@"; }}\n{make.split("#")[0]}\n'
              f'{answer.rsplit("#", 1)[0]} --json\n')
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    printed = json.loads(result.stdout[result.stdout.index("{"):])  # after the line `synthetic make` prints
    assert printed["budget"] == 64 and printed["label"] == "StateKV B=64"
    assert [a["answer"].strip() for a in printed["answers"]] == [expected]
    assert printed["answers"][0]["question"].endswith("D. yellow\nAnswer with the letter.")


def test_the_readme_shows_what_statekv_demo_prints(tmp_path):
    """README's demo output, run as written: every line but the timings (masked) is the demo's own."""
    shown = next(text for language, text in blocks(README) if language == "text" and "accuracy" in text)
    env = {**os.environ, "PYTHONPATH": str(REPO), "STATEKV_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "statekv.cli", "demo", "--plot", str(tmp_path / "demo.png")],
                            capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = result.stdout.splitlines()

    def masked(line: str) -> str:
        return re.sub(r" *\d+\.\d", " #", line.rstrip())  # milliseconds per frame (and their padding) vary

    for line in shown.strip().splitlines():
        if line.strip() in ("...", ""):
            continue
        assert any(masked(line) == masked(out) for out in printed), (line, result.stdout)
    assert (tmp_path / "demo.png").stat().st_size > 10_000
