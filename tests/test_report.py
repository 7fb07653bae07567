"""The HTML report: one self-contained file whose embedded plots decode as PNG, plus the same plots as files."""
from __future__ import annotations

import base64
import copy
import io
import re

import matplotlib.image
import pytest
import torch

import autopar
from autopar.models.llama import Llama, LlamaConfig, cross_entropy_loss
from autopar.plan import Plan
from autopar.inspect import write_report

CFG = LlamaConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_dim=2048, max_seq_len=128,
                  rope_theta=10000.0)
IMG = re.compile(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


@pytest.fixture(scope="module")
def plan():
    model = Llama(CFG)
    return autopar.plan(model, autopar.fake_mesh((2, 2), ("dp", "tp")), (torch.zeros(8, 128, dtype=torch.long),),
                        loss_fn=cross_entropy_loss, config=autopar.Config(device="h100"))


def _images(html: str) -> dict[str, bytes]:
    return {name: base64.b64decode(data) for name, data in IMG.findall(html)}


def test_report_embeds_decodable_pngs(plan, tmp_path):
    names = write_report(plan, tmp_path / "r.html", png_dir=tmp_path / "png")
    html = (tmp_path / "r.html").read_text()
    assert "<script" not in html and "http" not in html  # self-contained
    images = _images(html)
    assert list(images) == names
    assert {"placement_map", "memory", "top_ops", "timeline"} <= set(names)
    for name, png in images.items():
        assert png.startswith(b"\x89PNG")
        pixels = matplotlib.image.imread(io.BytesIO(png), format="png")
        assert pixels.ndim == 3 and pixels.shape[0] > 50 and pixels.shape[1] > 50, name
        assert (tmp_path / "png" / f"{name}.png").read_bytes() == png


def test_placement_map_has_one_row_per_param(plan, tmp_path):
    write_report(plan, tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    rows = re.findall(r'<tr class="param-row" data-key="([^"]+)">', html)
    assert sorted(rows) == sorted(plan.params) and len(rows) == 12
    assert "layers.* (x2)" in html and "(top level)" in html
    for section in ("Memory per rank", "Communication", "Top compute", "FP8", "Pipeline", "Simulated step"):
        assert f"<h2>{section}</h2>" in html
    assert "No FP8 matmuls chosen" in html and "No pipeline stages" in html


def test_report_of_a_loaded_plan_is_the_same(plan, tmp_path):
    loaded = Plan.from_json(plan.to_json())
    write_report(plan, tmp_path / "a.html")
    write_report(loaded, tmp_path / "b.html")
    assert (tmp_path / "a.html").read_text() == (tmp_path / "b.html").read_text()
    old = Plan.from_json(plan.to_json())
    old.timeline = []  # what a plan saved before timelines were recorded loads as
    names = write_report(old, tmp_path / "c.html")
    assert "timeline" not in names and "records no simulated timeline" in (tmp_path / "c.html").read_text()


def test_pipeline_section_and_plot_when_the_plan_has_stages(plan, tmp_path):
    staged = copy.copy(plan)
    staged.solver_stats = dict(plan.solver_stats, pipeline={
        "stages": 2, "schedule": "1F1B",
        "timeline": [(0, "F0", 0.0, 1e-3), (1, "F0", 1e-3, 2e-3), (1, "B0", 2e-3, 4e-3), (0, "B0", 4e-3, 6e-3)]})
    names = write_report(staged, tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    assert "pipeline" in names and "1F1B" in html
    assert "pp" in staged.techniques
