"""The report of benchmarks/serve_nodes.py, without a cluster: its rows come from `statekv bench serve`'s own
JSON (the fields its summary writes), a --find-max search is reported by the run of the most streams held, and
its subsection of docs/serving.md is replaced in place, the sections around it kept."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from statekv.bench.load import Request, Run
from statekv.bench.summary import Targets, summarize

ROOT = Path(__file__).resolve().parents[1]


def _script():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_serve_nodes", ROOT / "benchmarks" / "serve_nodes.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _row(streams: int, lag: float) -> dict:
    requests = [Request("frame", stream, due=k, sent=k, done=k + lag) for stream in range(streams) for k in range(10)]
    requests += [Request("question", 0, due=5.0, sent=5.0, first_token=5.2, done=5.3)]
    return summarize(Run(streams, 0.0, requests), fps=1.0, duration=10.0, targets=Targets(), mean_batch=1.5)


def test_the_table_shows_each_node_counts_runs_from_bench_serves_json():
    nodes = _script()
    rows = nodes.rows_of(2, {"results": [_row(4, 0.1), _row(8, 2.0)]})
    table = nodes.table(rows).splitlines()
    assert table[0] == nodes.COLUMNS and table[1].count("---:") == table[0].count(" | ") + 1
    assert table[2] == "| 2 | 2 | 4 | 4 | 4.0 | 0.100 | 0.200 | 0.200 | 4 | 0 | 1.50 |"  # 4 cameras at 1 fps
    assert table[3].startswith("| 2 | 2 | 8 | 0 | ")  # eight cameras, none held two seconds behind real time
    searched = {"results": [_row(1, 0.1), _row(2, 0.1), _row(4, 2.0), _row(3, 0.1)], "max_streams_held": 3,
                "search_complete": True}
    assert [row["streams"] for row in nodes.rows_of(3, searched)] == [3]
    assert "| 3 | 3 | 3 | 3 | " in nodes.table(nodes.rows_of(3, searched))
    capped = {**searched, "search_capped": True}  # every count up to the search's cap held: the most may be more
    assert "| 3 | 3 | 3 | at least 3 | " in nodes.table(nodes.rows_of(3, capped))


def test_its_subsection_of_the_docs_is_replaced_in_place(tmp_path):
    nodes = _script()
    docs = tmp_path / "serving.md"
    docs.write_text("# Serving\n\n## On a Ray cluster\n\n### Object storage alone\n\nrecipe\n\n"
                    f"### {nodes.SECTION}\n\nold table\n\n```bash\n# a comment, not a heading\n```\n\n"
                    "### Where requests go\n\nrouting\n\n## Measured load\n\nkept\n")
    nodes.write_section(docs, nodes.SECTION, "new table", level=3)
    assert docs.read_text() == ("# Serving\n\n## On a Ray cluster\n\n### Object storage alone\n\nrecipe\n\n"
                                f"### {nodes.SECTION}\n\nnew table\n\n### Where requests go\n\nrouting\n\n"
                                "## Measured load\n\nkept\n")
    nodes.write_section(docs, "Measured load", "replaced")  # a ## section still runs to the next ## heading
    assert docs.read_text().endswith("### Where requests go\n\nrouting\n\n## Measured load\n\nreplaced\n")
