"""Train pagoda-demo: a few-million-parameter Llama that solves small, checkable tasks, on CPU, from scratch.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/train_demo_model.py            # ~20 min on 2 cores
    .venv/bin/python scripts/train_demo_model.py --steps 300 --out /tmp/demo  # a quick trial

Everything follows from --seed: the corpus (pagoda.demo.tasks), the tokenizer, the init, the batch order.
Training runs a fixed number of steps, so a re-run reproduces the model; --max-minutes is only a guard
that stops early (and says so) on a machine much slower than the one the default was sized for.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

# Before torch loads OpenMP: on a shared machine, spinning threads wait on a busy sibling core and a step
# takes 3x longer than with sleeping ones.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from pagoda.demo import DEMO_MODEL_DIR, encode_prompts, transformers_greedy  # noqa: E402
from pagoda.demo.tasks import TASKS, Item, held_out_set, is_correct, training_stream  # noqa: E402

PAD, BOS, EOS, IM_START = "<pad>", "<s>", "<|im_end|>", "<|im_start|>"
# ChatML. The answer follows "<|im_start|>assistant\n" and ends with <|im_end|>, the eos token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Every digit, space and punctuation mark is a pre-token of its own, so BPE merges only within a run of
# letters: numbers are read digit by digit (arithmetic is learnable), and a word is the same token
# whether it follows a space, a newline or a quote (copying is learnable).
PRE_TOKEN = Regex(r"[^\W\d_]+|\d|\s|[^\w\s]|_")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=704)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-minutes", type=float, default=20.0, help="guard on the training loop")
    parser.add_argument("--eval-items", type=int, default=200, help="held-out items per task (0: skip)")
    return parser.parse_args()


def train_tokenizer(sample: list[Item], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Split(PRE_TOKEN, behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # any byte is encodable
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, IM_START],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = ("\n".join(m["content"] for m in item.messages()) + "\n" + item.answer for item in sample)
    tokenizer.train_from_iterator(itertools.chain(["system user assistant"] * 100, texts), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START], model_max_length=512,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def encode(tokenizer: PreTrainedTokenizerFast, items: list[Item]) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per item; the loss falls on the answer and its eos only."""
    prompts = encode_prompts(tokenizer, items)
    answers = tokenizer([it.answer for it in items], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [(p + a + [eos], [-100] * len(p) + a + [eos]) for p, a in zip(prompts, answers)]


def batches(tokenizer: PreTrainedTokenizerFast, seed: int, batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Right-padded batches of similar-length items: little padding, and no attention mask is needed
    because under a causal mask no real token can see the padding after it."""
    stream, rng, group = training_stream(seed), random.Random(seed), 16
    while True:
        items = list(itertools.islice(stream, batch_size * group))
        examples = sorted(encode(tokenizer, items), key=lambda example: len(example[0]))
        chunks = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _ in chunk])
            labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in chunk])
            yield ids, labels


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.mlp,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> tuple[torch.optim.Optimizer, object]:
    # No weight decay on norms (1-D): decaying their gains towards 0 only fights the normalisation.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )

    def lr_scale(step: int) -> float:  # linear warmup, then cosine down to a tenth
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_scale)


def train(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> dict:
    optimizer, schedule = make_optimizer(model, args)
    model.train()
    start, losses, step = time.monotonic(), [], 0
    for step, (ids, labels) in enumerate(batches(tokenizer, args.seed, args.batch_size), start=1):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        minutes = (time.monotonic() - start) / 60
        if step % 50 == 0 or step == args.steps:
            print(f"step {step:5d}/{args.steps}  loss {sum(losses[-50:]) / len(losses[-50:]):.4f}  "
                  f"lr {schedule.get_last_lr()[0]:.2e}  {minutes:.1f} min", flush=True)
        if step == args.steps:
            break
        if minutes > args.max_minutes:
            print(f"WARNING: stopped at step {step} of {args.steps}: --max-minutes {args.max_minutes} reached")
            break
    model.eval()
    return {"steps": step, "train_seconds": round(time.monotonic() - start, 1),
            "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4)}


def evaluate(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, items_per_task: int) -> dict:
    """Held-out exact-match accuracy per task, through `transformers` greedy generation."""
    accuracy = {}
    for task, items in held_out_set(items_per_task).items():
        outputs = transformers_greedy(model, tokenizer.pad_token_id, encode_prompts(tokenizer, items))
        texts = tokenizer.batch_decode(outputs, skip_special_tokens=True)
        accuracy[task] = round(100 * sum(map(is_correct, items, texts)) / len(items), 1)
        print(f"  {task:12s} {accuracy[task]:5.1f}%   e.g. {items[0].prompt!r} -> {texts[0]!r}", flush=True)
    return accuracy


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, log: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the template goes into tokenizer_config.json
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    began = time.monotonic()
    tokenizer = train_tokenizer(list(itertools.islice(training_stream(args.seed + 1), 40_000)), args.vocab_size)
    model = build_model(args, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tokenizer)}, {params / 1e6:.2f}M parameters, {len(TASKS)} task families", flush=True)
    log = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "parameters": params, "torch": torch.__version__, **train(model, tokenizer, args)}
    if args.eval_items:
        print(f"held-out exact match ({args.eval_items} items per task, transformers greedy):")
        log["eval_items_per_task"] = args.eval_items
        log["accuracy"] = evaluate(model, tokenizer, args.eval_items)
    log["total_seconds"] = round(time.monotonic() - began, 1)
    save(model, tokenizer, args.out, log)
    print(f"saved to {args.out} ({log['total_seconds'] / 60:.1f} min in all)")


if __name__ == "__main__":
    main()
