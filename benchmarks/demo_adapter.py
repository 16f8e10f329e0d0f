"""The demo adapter through pagoda: its task with and without it, and the base families untouched.

    .venv/bin/python benchmarks/demo_adapter.py              # 1,000 task items, 100 a base family (~2 min)

Three engines' greedy answers on held-out items (pagoda.demo.tasks): the `double` task on a LoRA engine with the
adapter (pagoda.demo.DEMO_ADAPTER_DIR) and without it, and every base family on a LoRA engine without an adapter
against a plain engine, token for token: an engine that serves adapters must not move the base model's answers.
Writes benchmarks/results/demo-adapter.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from provenance import write_result
from quality import correctness, score

from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.demo import DEMO_ADAPTER_DIR, DEMO_MODEL_DIR, encode_prompts
from pagoda.demo.tasks import generate, held_out_set

TASK = "double"
RESULTS = Path(__file__).resolve().parent / "results" / "demo-adapter.json"


def measure(task_items: int, items_per_family: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=48)
    task = generate(TASK, "test", task_items)
    base_items = [item for family in held_out_set(items_per_family).values() for item in family]
    lora = LLM(str(DEMO_MODEL_DIR), enable_lora=True, max_loras=1, max_num_seqs=64)
    tokenizer = lora.get_tokenizer()
    adapter = LoRARequest(TASK, 1, str(DEMO_ADAPTER_DIR))
    prompts, base_prompts = encode_prompts(tokenizer, task), encode_prompts(tokenizer, base_items)
    with_adapter = token_ids(lora.generate(prompts, params, lora_request=adapter, use_tqdm=False))
    without = token_ids(lora.generate(prompts, params, use_tqdm=False))
    base_on_lora = token_ids(lora.generate(base_prompts, params, use_tqdm=False))
    lora.close()
    with LLM(str(DEMO_MODEL_DIR), max_num_seqs=64) as plain:
        base_on_plain = token_ids(plain.generate(base_prompts, params, use_tqdm=False))
    return {
        "task": TASK, "task_items": task_items, "items_per_family": items_per_family,
        "accuracy_with_adapter": score(correctness(task, with_adapter, tokenizer))[TASK],
        "accuracy_without_adapter": score(correctness(task, without, tokenizer))[TASK],
        "example": {"prompt": task[0].prompt,
                    "with_adapter": tokenizer.decode(with_adapter[0], skip_special_tokens=True),
                    "without_adapter": tokenizer.decode(without[0], skip_special_tokens=True)},
        "base_same_tokens": sum(a == b for a, b in zip(base_on_lora, base_on_plain)), "base_items": len(base_items),
        "base_accuracy": score(correctness(base_items, base_on_lora, tokenizer)),
    }


def token_ids(outputs: list) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task-items", type=int, default=1000)
    parser.add_argument("--items-per-family", type=int, default=100)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = measure(args.task_items, args.items_per_family)
    print(f"{TASK}: {result['accuracy_with_adapter']:.1f}% with the adapter, "
          f"{result['accuracy_without_adapter']:.1f}% without; base families: {result['base_same_tokens']} of "
          f"{result['base_items']} answers token for token the plain engine's")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
