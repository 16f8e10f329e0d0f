"""The demo LoRA adapter through pagoda: it does its task, the base alone does not, and serving adapters leaves the
base model's answers where they were."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from demo_adapter import measure  # noqa: E402

from pagoda.demo import DEMO_ADAPTER_DIR  # noqa: E402


def test_the_adapter_teaches_its_task_and_leaves_the_base_families_alone():
    result = measure(task_items=100, items_per_family=8)
    assert result["accuracy_with_adapter"] >= 90
    assert result["accuracy_without_adapter"] <= 5
    assert result["base_same_tokens"] == result["base_items"] == 8 * len(result["base_accuracy"])


def test_the_adapter_is_a_peft_adapter_on_the_built_in_model():
    config = json.loads((DEMO_ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16 and config["base_model_name_or_path"] == "pagoda-demo"
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
