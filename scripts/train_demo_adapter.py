"""Train the demo LoRA adapter: a task the built-in model was never taught, learnt by a rank-16 adapter.

    .venv/bin/python scripts/train_demo_adapter.py          # ~35 min on 2 shared cores; writes the committed adapter
    .venv/bin/python scripts/train_demo_adapter.py --steps 50 --out /tmp/double   # a quick trial

The task is `double` (pagoda.demo.tasks.ADAPTER_TASKS: "Say each word twice: red tea" -> "red red tea tea").
The base model's weights stay frozen; PEFT trains A and B of every projection in fp32 on the task's training
split, with the base model's chat template and its answer-only loss. Everything follows from --seed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_demo_model.py: sleeping threads on shared cores

import peft  # noqa: E402
import torch  # noqa: E402
from train_demo_model import encode, exact_match, loss_fn, pad  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402

from pagoda.demo import DEMO_ADAPTER_DIR, DEMO_MODEL_DIR  # noqa: E402
from pagoda.demo.tasks import adapter_training_stream, generate  # noqa: E402

TASK = "double"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-items", type=int, default=200)
    parser.add_argument("--out", type=Path, default=DEMO_ADAPTER_DIR)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    began = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    base = LlamaForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    held_out = generate(TASK, "test", args.eval_items, args.seed)
    base_accuracy, _ = exact_match(base, tokenizer, held_out)
    config = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / args.steps)
    stream, losses = adapter_training_stream(TASK, args.seed), []
    for step in range(1, args.steps + 1):
        ids, role = pad(tokenizer, encode(tokenizer, list(itertools.islice(stream, args.batch_size))))
        loss, answer_loss = loss_fn(model, ids, role, prompt_weight=0.0)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(answer_loss.item())
        if step % 50 == 0 or step == args.steps:
            print(f"step {step:4d}/{args.steps}  answer loss {sum(losses[-50:]) / len(losses[-50:]):.4f}  "
                  f"{(time.monotonic() - began) / 60:.1f} min", flush=True)
    model.eval()
    log = {"task": TASK, "args": {k: v for k, v in vars(args).items() if k != "out"}, "torch": torch.__version__,
           "peft": peft.__version__, "final_answer_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
           "held_out_items": args.eval_items, "accuracy_base": base_accuracy,
           "accuracy_adapter": exact_match(model, tokenizer, held_out)[0]}
    print(f"held-out {TASK}: base {log['accuracy_base']}%, with the adapter {log['accuracy_adapter']}%")
    model.save_pretrained(args.out)
    # A path on the machine that trained it means nothing elsewhere: name the base as pagoda names it.
    config_path = args.out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = "pagoda-demo"
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    log["total_seconds"] = round(time.monotonic() - began, 1)
    (args.out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"saved to {args.out} ({log['total_seconds'] / 60:.1f} min in all)")


if __name__ == "__main__":
    main()
