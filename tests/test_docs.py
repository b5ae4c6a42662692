"""The docs' result tables are generated from bench/*.json and checked to be current."""
import json
import os
import re

import pytest

from fastdist.bench import report, results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH, DOCS = os.path.join(ROOT, "bench"), os.path.join(ROOT, "docs")

ENV = {"fastdist": "0.1.0", "torch": "2.13.0+cpu", "backend": "gloo", "device": "cpu", "ranks": 4,
       "network": "netsim: 4 hosts, 1 Gbit/s links", "cuda_kernels": False, "host_cpus": 2, "torch_threads": 2,
       "date": "2026-11-22T06:36:53", "command": "__main__.py compress --ranks 4 --net 1gbit"}
PIPELINE = {
    "suite": "compress", "env": ENV,
    "config": {"batch": 8, "seq": 4096, "hidden": 16, "steps": 5, "warmup": 2},
    "rows": [
        {"method": "none", "time_ms": 113.40788, "speedup": 1.0, "link_ms_model": 100.668672,
         "fwd_wire_bytes": 2097264.0, "bwd_wire_bytes": 2097264.0, "tx_bytes": 4204352.0, "dense_bytes": 2097152},
        {"method": "topk10+q8", "time_ms": 33.5832, "speedup": 3.3769230, "link_ms_model": 7.87392,
         "fwd_wire_bytes": 275424.0, "bwd_wire_bytes": 52656.0, "tx_bytes": 330358.0, "dense_bytes": 2097152},
    ],
}
EXPECTED_TABLE = """\
| method | step (ms) | vs none | link, model (ms) | fwd (B/boundary) | bwd (B/boundary) | tx (B/boundary) | fwd ratio |
|---|---:|---:|---:|---:|---:|---:|---:|
| none | 113.4 | 1.00x | 100.7 | 2097264 | 2097264 | 4204352 | 1.0x |
| topk10+q8 | 33.6 | 3.38x | 7.9 | 275424 | 52656 | 330358 | 7.6x |"""
PROSE_BEFORE = "# Compression\n\nHand-written findings: TopK 10% is the fastest.\n\n"
PROSE_AFTER = "\nMore hand-written prose.\n"


@pytest.fixture
def tree(tmp_path):
    """A bench folder with one recorded pipeline run and a docs page with an empty block for it."""
    bench, docs = tmp_path / "bench", tmp_path / "docs"
    bench.mkdir()
    docs.mkdir()
    (bench / "compress-4r.json").write_text(json.dumps(PIPELINE))
    page = docs / "compression.md"
    page.write_text(PROSE_BEFORE + "<!-- results:compress-4r -->\n<!-- /results -->\n" + PROSE_AFTER)
    return bench, docs, page


def test_make_docs_fills_the_block_with_the_recorded_table_and_keeps_the_prose(tree):
    bench, docs, page = tree
    assert results.main([str(bench), str(docs)]) == 0
    text = page.read_text()
    assert text.startswith(PROSE_BEFORE + "<!-- results:compress-4r -->\n")
    assert text.endswith("<!-- /results -->\n" + PROSE_AFTER)
    assert EXPECTED_TABLE in text
    assert "[bench/compress-4r.json](../bench/compress-4r.json)" in text
    assert "`fastdist-bench compress --ranks 4 --net 1gbit`" in text
    assert "netsim: 4 hosts, 1 Gbit/s links" in text
    assert results.main([str(bench), str(docs), "--check"]) == 0


def test_a_wrong_number_in_a_generated_table_fails_the_check_with_a_diff(tree, capsys):
    bench, docs, page = tree
    results.main([str(bench), str(docs)])
    page.write_text(page.read_text().replace("| topk10+q8 | 33.6 | 3.38x |", "| topk10+q8 | 31.2 | 3.38x |"))
    capsys.readouterr()

    assert results.main([str(bench), str(docs), "--check"]) == 1
    out = capsys.readouterr().out
    assert "-| topk10+q8 | 31.2 | 3.38x |" in out
    assert "+| topk10+q8 | 33.6 | 3.38x |" in out


def test_a_new_recording_makes_the_docs_stale_until_regenerated(tree, capsys):
    bench, docs, page = tree
    results.main([str(bench), str(docs)])
    rerun = json.loads(json.dumps(PIPELINE))
    rerun["rows"][1]["time_ms"] = 36.04
    (bench / "compress-4r.json").write_text(json.dumps(rerun))

    assert results.main([str(bench), str(docs), "--check"]) == 1
    assert results.main([str(bench), str(docs)]) == 0
    assert "| topk10+q8 | 36.0 |" in page.read_text()
    assert results.main([str(bench), str(docs), "--check"]) == 0


def test_a_recorded_file_shown_on_no_page_fails_the_check(tree, capsys):
    bench, docs, page = tree
    (bench / "compress-2r.json").write_text(json.dumps(PIPELINE))
    assert results.main([str(bench), str(docs)]) == 1
    assert "compress-2r.json is shown on no page" in capsys.readouterr().err


def test_a_marker_naming_no_recorded_file_or_part_fails_the_check(tree, capsys):
    bench, docs, page = tree
    for marker, message in [("compress-8r", "compress-8r.json is not a recorded suite result"),
                            ("compress-4r#kernels", "compress-4r.json has no part 'kernels'")]:
        page.write_text(f"<!-- results:compress-4r -->\n<!-- /results -->\n<!-- results:{marker} -->\n"
                        "<!-- /results -->\n")
        assert results.main([str(bench), str(docs), "--check"]) == 1
        assert message in capsys.readouterr().err


def test_a_part_marker_shows_only_that_table(tree):
    bench, docs, page = tree
    page.write_text("<!-- results:compress-4r#pipeline -->\n<!-- /results -->\n")
    assert results.main([str(bench), str(docs)]) == 0
    assert EXPECTED_TABLE in page.read_text()


def test_a_file_of_an_unknown_suite_fails_the_check_unless_listed_as_not_a_suite_result(tree, capsys, monkeypatch):
    bench, docs, page = tree
    (bench / "summary.json").write_text(json.dumps({"gpu": "H100", "phases": ["cuda"]}))
    assert results.main([str(bench), str(docs), "--check"]) == 1
    assert "summary.json: no renderer for suite None" in capsys.readouterr().err

    monkeypatch.setitem(results.NOT_SUITE_RESULTS, "summary.json", "gpu-check's phase summary")
    results.main([str(bench), str(docs)])
    assert results.main([str(bench), str(docs), "--check"]) == 0
    assert "skipped summary.json: gpu-check's phase summary" in capsys.readouterr().out


def test_a_column_keeps_one_format_whatever_the_magnitude():
    columns = [report.col("time (ms)", "t", report.fixed(1)), report.col("error", "e", report.scientific(2))]
    table = report.markdown_table(columns, [{"t": 101.94, "e": 0.012}, {"t": 82.59, "e": 1.7e-4}, {"t": 3.0, "e": 0}])
    assert table.splitlines()[2:] == ["| 101.9 | 1.20e-02 |", "| 82.6 | 1.70e-04 |", "| 3.0 | 0 |"]


def test_a_column_missing_from_every_row_is_left_out_and_a_missing_value_is_a_dash():
    columns = [report.col("method", "m"), report.col("tx (B)", "tx", report.integer),
               report.col("note", "note")]
    table = report.markdown_table(columns, [{"m": "dense", "tx": 10}, {"m": "auto", "tx": None}])
    assert table.splitlines() == ["| method | tx (B) |", "|---|---:|", "| dense | 10 |", "| auto | - |"]


def test_the_docs_tables_are_the_ones_generated_from_the_recorded_results(capsys):
    status = results.main([BENCH, DOCS, "--check"])
    captured = capsys.readouterr()
    assert status == 0, "docs/ is stale: run `make docs`\n" + captured.out + captured.err


def test_every_recorded_json_in_bench_is_rendered_from_its_suite():
    recorded, skipped, errors = results.load_results(BENCH)
    assert errors == []
    on_disk = {os.path.relpath(os.path.join(root, f), BENCH)[:-len(".json")]
               for root, _, files in os.walk(BENCH) for f in files if f.endswith(".json")}
    assert set(recorded) == on_disk - {name[:-len(".json")] for name in results.NOT_SUITE_RESULTS}
    assert all(recorded[name].parts for name in recorded)


def _links(path):
    text = open(path).read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", text)]


@pytest.mark.parametrize("page", ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(DOCS))])
def test_relative_links_in_readme_and_docs_point_to_files_that_exist(page):
    path = os.path.join(ROOT, page)
    missing = [link for link in _links(path) if not re.match(r"[a-z]+:", link)
               and not os.path.exists(os.path.join(os.path.dirname(path), link.split("#")[0]))]
    assert missing == []


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _section(text, heading):
    return text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]


def test_readme_sets_up_with_exactly_the_two_make_commands():
    block = re.search(r"```bash\n(.*?)```", _section(_readme(), "Set up"), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["make bench", "make test"]


def test_readme_recipes_marked_runnable_run_as_written(capsys):
    recipes = re.findall(r"<!-- runs in tests/test_docs.py -->\n```python\n(.*?)```", _readme(), re.S)
    assert len(recipes) == 2
    for recipe in recipes:
        exec(compile(recipe, "README.md", "exec"), {"__name__": "readme_recipe"})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] in ("True", "False")
    assert printed[1].endswith("bytes instead of 131072")


def test_readme_feature_table_gives_each_family_a_docs_page_and_its_status_in_words():
    rows = [line.split("|")[1:-1] for line in _section(_readme(), "What is in it").splitlines()
            if line.startswith("| ") and not line.startswith("| family")]
    assert len(rows) >= 7
    for family, _, status, docs in rows:
        assert not re.search(r"\d", status), f"{family.strip()}: measured numbers belong in docs/, not README"
        if status.strip() != "later":
            page = re.search(r"\]\((docs/[a-z]+\.md)\)", docs).group(1)
            assert os.path.exists(os.path.join(ROOT, page))


def test_readme_stays_a_short_first_read():
    assert len(_readme().split()) < 2000


def test_a_kernels_recording_of_every_family_gets_one_table_per_family():
    def row(op, family, case):
        return {"op": op, "family": family, "case": case, "bytes": 2 ** 20, "median_s": 1e-4, "gbps": 10.48576,
                "pct_copy": 40.0, "torch_median_s": 1e-3, "torch_gbps": 1.048576, "speedup": 10.0}

    recording = {"suite": "kernels", "env": ENV, "copy_gbps": 26.2,
                 "rows": [row("pack_bits", "bitpack", "65536 bits"), row("topk_compress", "topk", "256x65536 k=6554"),
                          row("topk_decompress", "topk", "256x65536 k=6554")]}
    parts = results.tables_of(recording)
    assert [p.name for p in parts] == ["bitpack", "topk"]
    assert parts[1].table.splitlines()[2:] == [
        "| topk_compress | 256x65536 k=6554 | 1.00 | 100.0 | 10.49 | 40.0 | 1.049 | 10.0x |",
        "| topk_decompress | 256x65536 k=6554 | 1.00 | 100.0 | 10.49 | 40.0 | 1.049 | 10.0x |"]
