"""The calculator page's Python side: its fields are `pagoda calc`'s flags and its figures the CLI's own (the
text the page shows equals the CLI's output for the same inputs), errors name the field, a model is never a
path, and the roofline's points are where the CLI's batch table puts decode. The page in a browser:
tests/test_web_ui.py."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
from fastapi.testclient import TestClient

from pagoda.calc.cli import main as calc_main
from pagoda.calc.page import FIELDS, CalcFieldError, calculate, presets
from pagoda.calc.presets import MODEL_CONFIGS
from pagoda.calc.shapes import GpuSpec
from pagoda.server.api import build_app
from pagoda.server.state import ServerState


def cli(*argv: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert calc_main(list(argv)) == 0
    return out.getvalue()


@pytest.mark.parametrize("fields", [
    {},
    {"model": "llama-3-70b", "gpu": "h200", "num_gpus": 4, "batch": 64, "seq_len": 8192},
    {"model": "qwen2.5-7b", "dtype": "int4", "kv_dtype": "fp8", "batch": "32", "prompt_len": 512},
    {"model": "70B", "gpu": "l4", "price_per_hour": 0.8, "spec_alpha": 0.7},
])
def test_the_page_shows_what_the_cli_prints_for_the_same_flags(fields):
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in fields.items()]
    report = calculate(fields)
    assert report["text"] == cli(*argv)
    assert report["json"] == json.loads(cli(*argv, "--json"))
    shown = [row["text"] for part in report["parts"] if "columns" not in part for row in part["rows"]]
    assert shown and all(text in report["text"] for text in shown)


def test_presets_carry_the_clis_defaults():
    offered = presets()
    assert offered["defaults"]["batch"] == 1 and offered["defaults"]["seq_len"] == 4096
    assert set(offered["defaults"]) == set(FIELDS)
    assert set(MODEL_CONFIGS) < set(offered["models"]) and "served" in offered["models"]


@pytest.mark.parametrize(("fields", "field"), [
    ({"model": "/etc/passwd"}, "model"),
    ({"model": "."}, "model"),
    ({"batch": "many"}, "batch"),
    ({"gpu": "abacus"}, "gpu"),
    ({"json": True}, "json"),
    ({"dtype": "int3"}, "fields"),
])
def test_refusals_name_the_field_and_a_path_is_never_read(fields, field):
    with pytest.raises(CalcFieldError) as refused:
        calculate(fields)
    assert refused.value.field == field


def test_a_pasted_or_served_config_is_the_model():
    config = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "intermediate_size": 1024, "vocab_size": 1000}
    pasted = calculate({"model": "mine"}, config=config)
    assert pasted["json"]["setup"]["architecture"] == "4 layers, hidden 512, 8 q / 2 kv heads x 64"
    served = calculate({"model": "served"}, served_config=config)
    assert served["json"]["memory"] == pasted["json"]["memory"]
    with pytest.raises(CalcFieldError) as refused:
        calculate({"model": "served"})
    assert refused.value.field == "model"
    with pytest.raises(CalcFieldError) as refused:
        calculate({}, config={"hidden_size": 4})
    assert refused.value.field == "config"


def test_this_machine_is_the_measured_spec_given():
    measured = GpuSpec("this machine", peak_tflops=0.5, bandwidth_tbps=0.02, memory_gb=24.0, source="measured")
    report = calculate({"gpu": "this-machine", "model": "bench-125m"}, measured=measured)
    setup = report["json"]["setup"]
    assert setup["gpu"] == "this machine" and setup["peak_flop_per_s"] == 0.5e12
    assert setup["bandwidth_bytes_per_s"] == 0.02e12
    with pytest.raises(CalcFieldError):
        calculate({"gpu": "this-machine"})


def test_the_roofline_meets_at_the_ridge_and_marks_the_chosen_batch():
    report = calculate({"batch": 8})
    roofline, setup = report["roofline"], report["json"]["setup"]
    peak, bandwidth = setup["peak_flop_per_s"], setup["bandwidth_bytes_per_s"]
    assert roofline["ridge"] == pytest.approx(report["json"]["roofline"]["ridge_flop_per_byte"])
    assert roofline["curve"][-1][1] == peak and roofline["curve"][0][1] < peak
    batches = [row["batch"] for row in report["json"]["decode_by_batch"]]
    assert [p["batch"] for p in roofline["decode"]] == batches
    chosen = [p for p in roofline["decode"] if p["chosen"]]
    assert [p["batch"] for p in chosen] == [8]
    assert chosen[0]["intensity"] == pytest.approx(report["json"]["roofline"]["intensity_flop_per_byte"])
    assert chosen[0]["flop_per_s"] == pytest.approx(report["json"]["roofline"]["attainable_flop_per_s"])
    assert chosen[0]["flop_per_s"] == pytest.approx(min(peak, bandwidth * chosen[0]["intensity"]))


def test_the_routes_answer_400s_naming_the_field():
    with TestClient(build_app(ServerState(model_name="m"))) as client:
        assert client.get("/calc/presets").json()["defaults"]["batch"] == 1
        answer = client.post("/calc/report", json={"fields": {"batch": 4}})
        assert answer.status_code == 200 and answer.json()["text"] == cli("--batch=4")
        refused = client.post("/calc/report", json={"fields": {"model": "/etc/passwd"}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
        assert client.post("/calc/report", json={"fields": {}, "extra": 1}).status_code == 400
        page = client.get("/calc")
        assert page.status_code == 200 and "calc.js" in page.text
