"""benchmarks/decode_tiles.py on the CPU (the Triton interpreter, --dry-run's tiny batches): the
head-major cache view holds the same values, and every searched candidate, in either cache
layout and with the launches serial or overlapped, matches the float32 reference."""

import json

import pytest
import torch

from tests.script_loader import load_benchmark_script

decode_tiles = load_benchmark_script("decode_tiles.py")


def test_head_major_view_holds_the_same_values_with_a_contiguous_page_per_head():
    cache = torch.randn(3, 16, 2, 8)
    hnd = decode_tiles.as_layout(cache, "hnd")
    assert hnd.shape == cache.shape and torch.equal(hnd, cache)
    assert hnd.stride() == (2 * 16 * 8, 8, 16 * 8, 1)  # one head's 16 tokens of a page are contiguous
    assert decode_tiles.as_layout(cache, "nhd") is cache
    with pytest.raises(ValueError, match="unknown cache layout"):
        decode_tiles.as_layout(cache, "dhn")


def test_dry_run_search_is_valid_in_both_layouts(tmp_path):
    out = tmp_path / "decode_tiles.json"
    assert decode_tiles.main(["--dry-run", "--fields", "overlap", "--passes", "1", "--layouts", "nhd,hnd",
                              "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["notes"] == []
    rows = result["rows"]
    assert {r["layout"] for r in rows} == {"nhd", "hnd"}
    assert {r["config"].split()[0] for r in rows} == {"serial", "overlap"}
    assert all(r["valid"] for r in rows)
    assert set(result["breakdown_us"]["hnd"][rows[0]["setting"]]) == {"big", "small", "merge"}
    assert set(result["best"]) == {"nhd", "hnd"}


def test_rejects_an_unknown_layout():
    with pytest.raises(SystemExit, match="unknown --layouts"):
        decode_tiles.main(["--dry-run", "--layouts", "nhd,xyz"])


def test_dry_run_grids_time_each_launch_grid_and_stay_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_tiles, "GRID_BIG", (1,))
    monkeypatch.setattr(decode_tiles, "GRID_SMALL", (1, 3))
    out = tmp_path / "decode_grids.json"
    assert decode_tiles.main(["--dry-run", "--grids", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    settings = {r["setting"] for r in rows}
    assert len(settings) == len(decode_tiles.DRY_SETTINGS)
    for setting in settings:
        mine = [r for r in rows if r["setting"] == setting]
        assert [(r["launch"], r["big_programs_per_sm"], r["small_programs_per_sm"]) for r in mine] == [
            ("small", None, 1), ("small", None, 3), ("total", 1, 1), ("total", 1, 3)]
    totals = [r for r in rows if r["launch"] == "total"]
    assert all(r["valid"] and r["max_abs_err"] < 1e-4 for r in totals)
    assert result["engine_programs_per_sm"] == decode_tiles.decode_tile_config(128, 4).graph_programs_per_sm
