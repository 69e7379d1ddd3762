"""The book and what it is built from: tables render as tables, math renders offline, page 08 shows the reference
figures, and the statements of the notebooks and the intro agree with the code.

The tests of the built HTML need a fresh build: they run when A4_BOOK_HTML names the built html folder, which
`make book` sets when it runs this file right after building (so `make test`, which builds the book, always runs
them). A plain `pytest tests` skips them rather than read a book left over from an older build. The other tests read
the sources and always run.
"""

from __future__ import annotations

import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from a4._overlay import REPO_ROOT, SOLUTIONS_ROOT
from a4.__main__ import benchmark_names
from a4.checkpoints import preset_config
from a4.course.checks import report
from a4.course.checks import state_pool as state_checks
from a4.course.checks.common import QWEN3_5_PRESETS
from a4.course.exercises import all_exercises
from a4.course.notebooks import notebook_paths, read_notebook
from a4.layers.rope import RotaryEmbedding
from a4.models.config import parse_config

NOTEBOOKS = notebook_paths(REPO_ROOT)
HINT_MARK = "# Hint for intra_chunk"


def code_sources(notebook: Path) -> list[str]:
    return [cell.source for cell in read_notebook(notebook).cells if cell.cell_type == "code"]


# --------------------------------------------------------------------------------------------------- the built book


@pytest.fixture(scope="module")
def html_dir() -> Path:
    if "A4_BOOK_HTML" not in os.environ:
        pytest.skip("needs a fresh book: `make book` runs these tests after building it (A4_BOOK_HTML)")
    path = Path(os.environ["A4_BOOK_HTML"])
    path = path if path.is_absolute() else REPO_ROOT / path
    if not (path / "book" / "intro.html").exists():
        pytest.fail(f"A4_BOOK_HTML={path} holds no built book (no book/intro.html)")
    return path


def page(html_dir: Path, stem: str) -> str:
    return (html_dir / "notebooks" / f"{stem}.html").read_text()


def pages(html_dir: Path) -> dict[str, str]:
    """Every page of the book by name: the intro and one page per notebook."""
    found = {"intro": (html_dir / "book" / "intro.html").read_text()}
    found |= {nb.stem: page(html_dir, nb.stem) for nb in NOTEBOOKS}
    return found


def executed(html_dir: Path, stem: str) -> dict:
    """The notebook as the book build ran it: its outputs from the cache `make book` filled and the build read
    (book/_config.yml; the copy Jupyter Book writes beside the html folder keeps the source's empty outputs)."""
    from jupyter_cache import get_cache

    source = read_notebook(REPO_ROOT / "notebooks" / f"{stem}.ipynb")
    _, notebook = get_cache(str(html_dir.parent / ".jupyter_cache")).merge_match_into_notebook(source)
    return notebook


class TableParser(HTMLParser):
    """Every <table> of a page as rows of cell texts (whitespace collapsed)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th") and self.tables:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


# Sphinx's smart quotes: how plain quotes and dashes of the Markdown appear in the HTML.
TYPOGRAPHY = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"'})


def html_tables(html: str) -> list[list[list[str]]]:
    parser = TableParser()
    parser.feed(html.translate(TYPOGRAPHY))
    return parser.tables


SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")


def markdown_tables(notebook: dict) -> list[tuple[list[str], int]]:
    """(header cell texts, body rows) of every table a cell displayed as Markdown (`display(Markdown(...))`)."""
    found = []
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            text = "".join(output.get("data", {}).get("text/markdown", ""))
            lines = [line.strip() for line in text.strip().splitlines()]
            for i, line in enumerate(lines):
                if i > 0 and SEPARATOR.match(line):
                    header = [re.sub(r"\*\*|`", "", c).strip() for c in lines[i - 1].strip("|").split("|")]
                    body = sum(1 for row in lines[i + 1 :] if row.startswith("|"))
                    found.append((header, body))
    return found


def test_no_page_shows_a_table_as_a_paragraph_of_pipes(html_dir):
    for name, html in pages(html_dir).items():
        assert not re.search(r"<p>\s*\|", html), f"{name}: a Markdown table rendered as a paragraph of pipes"


def test_every_table_a_notebook_displays_is_an_html_table(html_dir):
    tables_seen = {}
    for nb in NOTEBOOKS:
        displayed = markdown_tables(executed(html_dir, nb.stem))
        rendered = [(table[0], len(table) - 1) for table in html_tables(page(html_dir, nb.stem)) if table]
        for header, body in displayed:
            assert (header, body) in rendered, f"{nb.stem}: the table with header {header} is not an HTML table"
        tables_seen[nb.stem] = len(displayed)
    # The pages the issue saw broken have such tables (the test above is not vacuous there).
    assert all(tables_seen[stem] > 0 for stem in ("00_tour", "04_gated_deltanet", "06_memory_plan")), tables_seen


def test_math_renders_offline(html_dir):
    for name, html in pages(html_dir).items():
        assert "cdn.jsdelivr.net" not in html and not re.search(r"src=\"https?://[^\"]*mathjax", html, re.I), name
    html = page(html_dir, "04_gated_deltanet")
    assert 'class="math' in html, "notebook 04 should have formulas"
    scripts = re.findall(r"<script[^>]*src=\"([^\"]*mathjax[^\"]*)\"", html, re.I)
    assert scripts, "no MathJax script on a page with formulas"
    for src in scripts:
        assert (html_dir / "notebooks" / src.split("?")[0]).resolve().is_file(), f"{src} is not in the build"
    assert list((html_dir / "_static" / "mathjax").rglob("*.woff")), "MathJax's fonts are not in the build"


def test_page_08_shows_the_reference_figures(html_dir):
    html = page(html_dir, "08_report")
    assert "No bench-out" not in html
    nb = executed(html_dir, "08_report")
    cells = [cell for cell in nb["cells"] if "checks.bench_report(" in "".join(cell["source"])]
    assert len(cells) == 4
    for cell in cells:
        shown = {mime for output in cell["outputs"] for mime in output.get("data", {})}
        assert shown & {"image/png", "text/markdown"}, f"no figure or table from {''.join(cell['source'])[:60]!r}"
        assert "reference run" in "".join("".join(o.get("text", "")) for o in cell["outputs"])


def test_intra_chunk_hint_is_collapsed_on_its_page(html_dir):
    html = page(html_dir, "04_gated_deltanet")
    hint = html.index(HINT_MARK)
    cell_start = html.rfind('<div class="cell ', 0, hint)
    assert "tag_hide-cell" in html[cell_start : html.index(">", cell_start)]
    # The source and output sit in a closed <details> ("Show code cell content").
    assert re.search(r"<details class=\"[^\"]*hide[^\"]*\">", html[cell_start:hint])


def test_radix_tree_picture_is_drawn(html_dir):
    nb = executed(html_dir, "07_radix_cache")
    [cell] = [cell for cell in nb["cells"] if "draw_tree(llm.engine" in "".join(cell["source"])]
    assert any("image/png" in output.get("data", {}) for output in cell["outputs"])


# ---------------------------------------------------------------------------------------------------- the sources


def test_intro_lists_every_notebooks_exercise_files():
    rows = {
        row.split("·")[0].strip("| ").strip(): row
        for row in (REPO_ROOT / "book" / "intro.md").read_text().splitlines()
        if re.match(r"^\| \d\d ·", row)
    }
    for exercise in all_exercises():
        number = exercise.notebook[:2]
        assert f"`{exercise.student_path.as_posix()}`" in rows[number], (exercise.id, rows[number])


def test_intra_chunk_hint_is_a_collapsed_cell_in_jupyterlab():
    notebook = read_notebook(REPO_ROOT / "notebooks" / "04_gated_deltanet.ipynb")
    [cell] = [c for c in notebook.cells if HINT_MARK in c.source]
    assert cell.metadata["jupyter"] == {"source_hidden": True, "outputs_hidden": True}
    assert "hide-cell" in cell.metadata["tags"]


def markdown_of(notebook: str) -> str:
    cells = read_notebook(REPO_ROOT / "notebooks" / notebook).cells
    return "\n".join(cell.source for cell in cells if cell.cell_type == "markdown")


def test_notebook_10_states_the_figures_of_its_h200_run():
    """The prose of notebook 10 quotes the H200 run it draws (solutions/report/h200_gpu.json), as the cells print
    them: the kernels of a decode step, their GPU time and wall time each, the copy and GEMM rates, the floors."""
    h200 = json.loads((SOLUTIONS_ROOT / "report" / "h200_gpu.json").read_text())
    floor = h200["floor"]
    [eager, captured] = [p for p in h200["launch_profile"] if p["step"] == "decode" and p["batch"] == 1]
    assert (eager["system"], captured["system"]) == ("a4_no_graphs", "a4")
    # One profile of the same step: with and without CUDA graphs it launches the same kernels.
    assert eager["kernels"] == captured["kernels"]
    text = " ".join(markdown_of("10_gpu.ipynb").split())  # prose lines rewrapped
    stated = [
        f"launches {eager['kernels']:,} kernels at batch 1",
        f"{eager['kernel_ms'] / eager['kernels'] * 1e3:.1f} µs of GPU time each",
        f"{eager['wall_ms'] / eager['kernels'] * 1e3:.0f} µs of wall time per kernel",
        f"{eager['wall_ms'] / eager['kernels'] * 1e3:.0f} µs: the launch",
        f"{floor['weight_bytes'] / 1e9:.2f} GB of bf16 weights",
        f"copy rate of {floor['hbm_bytes_per_s'] / 1e12:.2f} TB/s",
        f"about {floor['decode_floor_ms']['1']:.2f} ms at batch 1, "
        f"{floor['decode_floor_ms']['128']:.1f} ms at batch 128",
        f"measured {floor['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s",
        f"2,048 tokens take about {floor['prefill_floor_ms']['2048']:.1f} ms",
        # 2 FLOPs per weight per token, over the prefill floor's time at the GEMM rate.
        f"(~{floor['prefill_floor_ms']['2048'] / 1e3 * floor['bf16_flop_per_s'] / (2 * 2048) / 1e9:.1f}B of them)",
        # 128k tokens of K and V (2 x 2 KV heads x 256 dims x 2 bytes per token) in one attention layer.
        f"about {2**17 * 2 * 2 * 256 * 2 / floor['hbm_bytes_per_s'] * 1e6:.0f} µs each at the measured copy rate",
    ]
    assert [figure for figure in stated if figure not in text] == []
    stale = re.compile(r"couple of thousand kernels|multiply-adds of weight GEMMs|few microseconds a launch", re.I)
    assert not stale.search(text)


def test_the_tour_and_every_next_section_link_the_notebooks():
    """Notebook 00's map links every notebook after it, and each notebook ends with a "## Next" section that links the
    one after it (Jupyter and the book both follow a link to a notebook file): none is reached only by its number."""
    [tour] = [cell.source for cell in read_notebook(NOTEBOOKS[0]).cells if "the map of the course" in cell.source]
    assert [nb.name for nb in NOTEBOOKS[1:] if f"]({nb.name})" not in tour] == []
    for notebook, following in zip(NOTEBOOKS[1:], NOTEBOOKS[2:]):
        last = read_notebook(notebook).cells[-1]
        assert last.cell_type == "markdown" and last.source.startswith("## Next\n"), notebook.name
        assert f"]({following.name})" in last.source, f"{notebook.name}'s Next section does not link {following.name}"
    assert read_notebook(NOTEBOOKS[-1]).cells[-1].source.startswith("## Next\n")


def test_bench_commands_in_the_notebooks_exist():
    names = set(benchmark_names())
    for nb in NOTEBOOKS:
        text = "\n".join(cell.source for cell in read_notebook(nb).cells)
        used = re.findall(r"python -m a4 bench ([a-z0-9][a-z0-9_-]*)", text)
        used += re.findall(r"bench_report\(\"([^\"]+)\"", text)
        assert set(used) <= names, f"{nb.name}: {sorted(set(used) - names)} are not benchmarks ({sorted(names)})"


def test_bench_report_finds_your_run_then_the_reference(tmp_path, capsys):
    reference = json.loads((SOLUTIONS_ROOT / "report" / "decode_context.json").read_text())
    assert report.bench_report("decode-context", out_dir=tmp_path) == reference
    assert "reference run: solutions/report/decode_context.json" in capsys.readouterr().out
    (tmp_path / "decode_context.json").write_text('{"mine": 1}')
    assert report.bench_report("decode-context", out_dir=tmp_path) == {"mine": 1}
    assert report.bench_report("prefill", out_dir=tmp_path, reference_dir=tmp_path / "none") is None
    assert "python -m a4 bench prefill --out " in capsys.readouterr().out


@pytest.mark.parametrize("arch, preset", QWEN3_5_PRESETS)
def test_mrope_is_ordinary_rope_for_text(arch, preset):
    """What notebook 01 says: with t = h = w = p, transformers' M-RoPE angles are a4's RoPE angles; not for images."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    raw = preset_config(arch, preset)
    config = parse_config(raw)
    mrope = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**raw["text_config"]))
    positions = torch.arange(1024)
    cos, sin = RotaryEmbedding(config.rotary_dim, config.rope_theta, len(positions))(positions, torch.float32)
    text_cos, text_sin = mrope(torch.zeros(1), positions.expand(3, 1, -1))
    assert torch.allclose(text_cos[0], cos) and torch.allclose(text_sin[0], sin)
    image = torch.stack([torch.zeros_like(positions), positions // 32, positions % 32])[:, None]
    assert not torch.allclose(mrope(torch.zeros(1), image)[0][0], cos)


def test_gdn_chunk_statements_follow_the_layer(monkeypatch):
    """The chunk size the checks describe is the one the GDN layer runs its prefill with (not a number in prose)."""
    import inspect

    from a4.bench._states import LayerStates
    from a4.core import ForwardMode
    from a4.engine.forward_batch import build_forward_batch
    from a4.layers import deltanet, gdn_backend

    used = []
    original = deltanet.chunk_gated_delta_rule

    def spy(*args, **kwargs):
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        used.append(bound.arguments["chunk_size"])
        return original(*args, **kwargs)

    config = parse_config(preset_config("qwen3_5", "tiny"))
    layer = deltanet.GatedDeltaNet(config)
    states = LayerStates(
        torch.zeros(1, config.conv_dim, config.linear_conv_kernel_dim - 1),
        torch.zeros(1, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
    )
    fb = build_forward_batch(
        ForwardMode.EXTEND, input_ids=[0] * 40, slots=[0], prefix_lens=[0], extend_lens=[40], sample_indices=[39],
        req_to_token=torch.zeros(1, 64, dtype=torch.long), kv_pool=None, state_pool=states,
    )  # fmt: skip
    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr(gdn_backend, "chunk_gated_delta_rule", spy)  # the eager backend's name for notebook 04's rule
        layer(torch.randn(40, config.hidden_size), fb, 0)
    size = state_checks.gdn_chunk_size()
    assert used == [size]
    full, rest = divmod(130, size)
    assert state_checks.describe_chunks(130).startswith(f"{full + (rest > 0)} GDN chunks of {size}")
    stale = re.compile(r"64-token (GDN )?chunk|two (GDN )?chunks", re.I)
    for path in [*NOTEBOOKS, REPO_ROOT / "a4" / "course" / "checks" / "state_pool.py"]:
        assert not stale.search(path.read_text()), f"{path.name} states a chunk size instead of deriving it"
