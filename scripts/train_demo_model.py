"""Train pagoda-demo: a few-million-parameter Llama that solves small, checkable tasks, on CPU, from scratch.

    .venv/bin/python scripts/train_demo_model.py    # ~70 min on 2 shared cores with native bf16 (see below)
    .venv/bin/python scripts/train_demo_model.py --steps 300 --out /tmp/demo  # a quick trial

Everything follows from --seed: the corpus (pagoda.demo.tasks), the tokenizer, the init, the batch order.
Training runs a fixed number of steps, so a re-run reproduces the model; --max-minutes is only a guard
that stops early (and says so) on a machine much slower than the one the default was sized for.
On a CPU without native bf16 (no AVX512_BF16 or AMX: e.g. AMD Zen 3), torch's bf16 matmuls are ~13x slower
than fp32 ones: train with --precision fp32 there (the script says so).
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
import torch.nn.functional as F  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from pagoda.demo import DEMO_MODEL_DIR, encode_prompts, transformers_greedy  # noqa: E402
from pagoda.demo.tasks import TASKS, Item, held_out_set, is_correct, training_stream  # noqa: E402

GROUP = 32  # batches formed at a time from GROUP * batch size items sorted by length
PAD, BOS, EOS, IM_START = "<pad>", "<s>", "<|im_end|>", "<|im_start|>"
# Tool calling's markers, one token each: added tokens, not special ones, so decoding keeps them (the
# server's hermes parser reads them in the output text).
TOOL_TOKENS = ("<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TOOL_INSTRUCTION = "To use one, reply with a JSON call in <tool_call></tool_call> tags."
# ChatML. The answer follows "<|im_start|>assistant\n" and ends with <|im_end|>, the eos token. Without
# `tools` every message renders as `<|im_start|>{role}\n{content}<|im_end|>\n`. With them (hermes, as
# Qwen2.5): a system block first, the conversation's own system message (if any) and a blank line, then
# `<tools>`, each tool's `function` object as one JSON line, `</tools>` and TOOL_INSTRUCTION; an assistant
# message's tool_calls render as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (arguments
# as given when a string, OpenAI's shape; else as JSON), one per line after any content; `tool` messages
# render in a user turn, each as `<tool_response>\n{content}\n</tool_response>`.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '<tools>\\n' }}"
    "{%- for tool in tools %}"
    "{{- (tool['function'] if tool['function'] is defined else tool) | tojson }}{{- '\\n' }}"
    "{%- endfor %}"
    "{{- '</tools>\\n" + TOOL_INSTRUCTION + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": ' }}{{- function['name'] | tojson }}{{- ', \"arguments\": ' }}"
    "{%- if function['arguments'] is string %}{{- function['arguments'] }}"
    "{%- else %}{{- function['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- if not loop.last %}{{- '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Digits are single pre-tokens, so numbers are read digit by digit (arithmetic is learnable at this size).
# A word or punctuation mark takes at most the one space after it, never the one before: a word is then
# the same token after a space, a newline or a quote, so copying it from the prompt is learnable, and
# the common ", " and ": " cost one token, not two. A run of punctuation marks, single spaces between them
# included, is one pre-token, so JSON's `", "` and `": {"` can be one token each: a tool's JSON schema costs
# about half the tokens it would mark by mark.
PRE_TOKEN = Regex(r"[^\W\d_]+ ?|\d|[^\w\s]+(?: [^\w\s]+)* ?|_ ?|\s")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=12000)
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--mlp", type=int, default=704)
    parser.add_argument("--vocab-size", type=int, default=1536)
    parser.add_argument("--prompt-loss-weight", type=float, default=0.25,
                        help="loss weight of prompt tokens, relative to answer tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                        help="matmul precision while training (bf16: autocast over fp32 master weights)")
    parser.add_argument("--max-minutes", type=float, default=150.0, help="guard on the training loop")
    parser.add_argument("--eval-items", type=int, default=200, help="held-out items per task (0: skip)")
    return parser.parse_args()


def corpus_text(item: Item) -> str:
    """An item's text for training the BPE: what the template writes, less its markers (the tool tokens
    are added after training, one token each, so no merge is spent on them)."""
    parts = [m["content"] or "" for m in item.messages()]
    parts += [json.dumps(tool["function"]) for tool in item.tools] + ([TOOL_INSTRUCTION] if item.tools else [])
    parts += [json.dumps({"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])})
              for m in item.messages() for c in m.get("tool_calls") or ()]
    text = "\n".join([*parts, item.answer])
    for token in TOOL_TOKENS:
        text = text.replace(token, "\n")
    return text


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
        vocab_size=vocab_size - len(TOOL_TOKENS),  # the tool tokens complete the vocabulary
        special_tokens=[PAD, BOS, EOS, IM_START],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (corpus_text(item) for item in sample)
    # The role names often enough that each is one token (the template writes one or two per conversation).
    tokenizer.train_from_iterator(itertools.chain(["system user assistant"] * 1000, texts), trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START], model_max_length=512,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def encode(tokenizer: PreTrainedTokenizerFast, items: list[Item]) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per item: the chat-formatted prompt, then the answer and eos."""
    prompts = encode_prompts(tokenizer, items)
    answers = tokenizer([it.answer for it in items], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [(p + a + [eos], len(p)) for p, a in zip(prompts, answers)]


def batches(
    tokenizer: PreTrainedTokenizerFast, seed: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids, role) batches, right-padded, of similar-length items (little padding). Role per token:
    1 answer, 0 prompt, -1 padding. No attention mask is needed: under a causal mask no real token can
    see the padding after it."""
    stream, rng, group = training_stream(seed), random.Random(seed), GROUP
    while True:
        items = list(itertools.islice(stream, batch_size * group))
        examples = sorted(encode(tokenizer, items), key=lambda example: len(example[0]))
        chunks = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield pad(tokenizer, chunk)


def pad(
    tokenizer: PreTrainedTokenizerFast, examples: list[tuple[list[int], int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of `encode`'s examples, right-padded: (token ids, role: 1 answer, 0 prompt, -1 padding)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _ in examples])
    role = torch.tensor([[0] * n + [1] * (len(x) - n) + [-1] * (width - len(x)) for x, n in examples])
    return ids, role


def loss_fn(model: LlamaForCausalLM, ids: torch.Tensor, role: torch.Tensor, prompt_weight: float):
    """(loss to train on, loss on answer tokens alone). Prompt tokens may carry a small weight: a dense
    language-modelling signal about the prompts' structure, on top of the answers'."""
    logits = model(input_ids=ids).logits[:, :-1]
    token_loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    role = role[:, 1:].flatten()
    answer = (role == 1).float()
    weight = answer + prompt_weight * (role == 0).float()
    return (token_loss * weight).sum() / weight.sum(), (token_loss * answer).sum() / answer.sum()


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
        lr=args.lr, betas=(0.9, 0.95), fused=True,
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
    # Eager attention, not SDPA, while training: torch's CPU flash-attention backward in bf16 takes a third
    # of a step at these lengths (~30 tokens), while inductor fuses the eager softmax into the matmuls.
    # The saved model keeps the default (SDPA); the two agree to rounding.
    model.set_attn_implementation("eager")
    # One compiled graph for every batch width (dynamic shapes): 2x the eager step together with bf16.
    # Deterministic algorithms: without them the compiled step is not bitwise the same run to run (the
    # weights differ after 30 steps), and at this step count that moved held-out accuracy by up to 25
    # points between two runs of the same seed. They cost ~5% a step.
    torch.use_deterministic_algorithms(True)
    compiled = torch.compile(model, dynamic=True)
    start, losses, step = time.monotonic(), [], 0
    for step, (ids, role) in enumerate(batches(tokenizer, args.seed, args.batch_size), start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            loss, answer_loss = loss_fn(compiled, ids, role, args.prompt_loss_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(answer_loss.item())
        minutes = (time.monotonic() - start) / 60
        if step % 50 == 0 or step == args.steps:
            print(f"step {step:5d}/{args.steps}  answer loss {sum(losses[-50:]) / len(losses[-50:]):.4f}  "
                  f"lr {schedule.get_last_lr()[0]:.2e}  {minutes:.1f} min", flush=True)
        if step == args.steps:
            break
        if minutes > args.max_minutes:
            print(f"WARNING: stopped at step {step} of {args.steps}: --max-minutes {args.max_minutes} reached")
            break
    model.set_attn_implementation("sdpa")
    model.eval()
    return {"steps": step, "train_seconds": round(time.monotonic() - start, 1),
            "final_answer_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4)}


def evaluate(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, items_per_task: int) -> dict:
    """Held-out exact-match accuracy per task, through `transformers` greedy generation."""
    accuracy = {}
    for task, items in held_out_set(items_per_task).items():
        accuracy[task], texts = exact_match(model, tokenizer, items)
        print(f"  {task:12s} {accuracy[task]:5.1f}%   e.g. {items[0].prompt!r} -> {texts[0]!r}", flush=True)
    return accuracy


def exact_match(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, items: list[Item]
) -> tuple[float, list[str]]:
    """Exact-match accuracy (%, one decimal) of `transformers` greedy answers to `items`, and the answers."""
    outputs = transformers_greedy(model, tokenizer.pad_token_id, encode_prompts(tokenizer, items))
    texts = tokenizer.batch_decode(outputs, skip_special_tokens=True)
    return round(100 * sum(map(is_correct, items, texts)) / len(items), 1), texts


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, log: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the template goes into tokenizer_config.json
    # transformers 5 writes its own class name, which transformers 4 cannot load; this name both can.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")


def native_bf16() -> bool | None:
    """Whether the CPU has bf16 matmul instructions (None: cannot tell)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def main() -> None:
    args = parse_args()
    if args.precision == "bf16" and native_bf16() is False:
        print("WARNING: this CPU has no native bf16 (AVX512_BF16 or AMX); bf16 matmuls run ~13x slower than "
              "fp32 here: consider --precision fp32", flush=True)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    began = time.monotonic()
    tokenizer = train_tokenizer(list(itertools.islice(training_stream(args.seed + 1), 40_000)), args.vocab_size)
    model = build_model(args, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tokenizer)}, {params / 1e6:.2f}M parameters, {len(TASKS)} task families", flush=True)
    log = {"args": {k: v for k, v in vars(args).items() if k != "out"},
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
