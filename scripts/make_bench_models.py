#!/usr/bin/env python
"""Make pagoda's two benchmark models, with seeded random weights, under models/.

bench-125m (SmolLM-135M's shape with a 32000 vocab) is for serving and throughput; bench-1b (TinyLlama's
shape, tied) for batch-1 roofline claims, since bench-125m's weights fit in a server CPU's L3 cache.
bench-moe is a Mixtral of 8 experts, top 2, 0.98B parameters of which 0.30B are active per token, and
bench-moe-dense the dense Llama with the same active parameters (its MLP as wide as two experts), for
benchmarks/moe_decode.py.

    python scripts/make_bench_models.py                 # bench-125m and bench-1b, skipping any that exist
    python scripts/make_bench_models.py --only bench-moe --only bench-moe-dense
    python scripts/make_bench_models.py --only bench-125m --force
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.testing import make_checkpoint, make_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 32000
SEED = 0


@dataclass(frozen=True)
class BenchModel:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    expected_params: float  # asserted to 0.5%
    arch: str = "llama"
    experts: int = 0  # a Mixtral's experts per layer, two of them per token; 0: dense

    @property
    def init_std(self) -> float:
        # Same scale-free spread as the test models (0.2 at hidden 64): q.k and logits then have O(1)
        # spread, so greedy choices are decisive and generation does not collapse into one repeated token.
        return 1.6 / math.sqrt(self.hidden_size)


BENCH_MODELS = {
    model.name: model
    for model in (
        BenchModel("bench-125m", 576, 30, 9, 3, 1536, expected_params=124.6e6),
        # TinyLlama's shape: ~1.1B with its untied LM head; tied, as here, the same shape is 1.03B.
        BenchModel("bench-1b", 2048, 22, 32, 4, 5632, expected_params=1.035e9),
        BenchModel("bench-moe", 1024, 16, 16, 4, 2304, expected_params=0.981e9, arch="mixtral", experts=8),
        BenchModel("bench-moe-dense", 1024, 16, 16, 4, 2 * 2304, expected_params=0.301e9),
    )
}


def log(message: str) -> None:
    print(message, flush=True)


def build(model: BenchModel, out_dir: Path, dtype: torch.dtype) -> None:
    # Build in a fresh directory next to the target and rename it at the end: an interrupted run leaves
    # no half-made model that a later run would skip, and two concurrent runs cannot clobber each other.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp_dir.chmod(0o755)
    log(f"{model.name}: {dtype}, init std {model.init_std:.4f} -> {out_dir}")
    try:
        write_model(model, tmp_dir, dtype)
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp_dir.rename(out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def write_model(model: BenchModel, out_dir: Path, dtype: torch.dtype) -> None:
    started = time.perf_counter()
    make_tokenizer(out_dir, vocab_size=VOCAB_SIZE, seed=SEED)
    log(f"  tokenizer ({VOCAB_SIZE} tokens) {time.perf_counter() - started:.1f}s")

    started = time.perf_counter()
    experts = {"num_local_experts": model.experts, "num_experts_per_tok": 2} if model.experts else {}
    make_checkpoint(
        out_dir,
        model.arch,
        seed=SEED,
        vocab_size=VOCAB_SIZE,
        hidden_size=model.hidden_size,
        num_layers=model.num_layers,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        intermediate_size=model.intermediate_size,
        max_position_embeddings=4096,
        init_std=model.init_std,
        dtype=dtype,
        tie_word_embeddings=True,
        **experts,
    )
    log(f"  weights + save {time.perf_counter() - started:.1f}s")


@torch.no_grad()
def check(model: BenchModel, model_dir: Path, num_new_tokens: int = 16) -> bool:
    """Load with transformers: the parameter count is the expected one, and greedy tokens vary."""
    import transformers

    started = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_params = hf_model.num_parameters()  # the tied embedding counted once
    if abs(num_params / model.expected_params - 1) > 0.005:
        log(f"  ERROR: {num_params} params, expected {model.expected_params:.4g}")
        return False
    prompt = tokenizer("The quick brown fox jumps over the lazy dog, 12 times.", return_tensors="pt")
    out = hf_model.generate(
        **prompt,
        max_new_tokens=num_new_tokens,
        do_sample=False,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new_tokens = out.sequences[0, prompt["input_ids"].shape[1] :].tolist()
    top2 = torch.stack([logits[0].topk(2).values for logits in out.logits])
    relative_gaps = (top2[:, 0] - top2[:, 1]) / top2[:, 0].abs().clamp(min=1)
    log(
        f"  check: {num_params / 1e6:.1f}M params, {len(set(new_tokens))}/{len(new_tokens)} distinct greedy "
        f"tokens, logit std {torch.stack(out.logits).std():.2f}, median top-2 gap {relative_gaps.median():.4f} "
        f"({time.perf_counter() - started:.1f}s)"
    )
    if len(set(new_tokens)) < num_new_tokens // 4:
        log(f"  ERROR: {model_dir.name} repeats itself: {new_tokens}")
        return False
    return True


def is_complete(model_dir: Path) -> bool:
    names = ("config.json", "tokenizer.json", "tokenizer_config.json")
    return all((model_dir / name).exists() for name in names) and any(model_dir.glob("*.safetensors"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(BENCH_MODELS), action="append", help="make only this model")
    parser.add_argument("--all", action="store_true", help="also the MoE pair (bench-moe, bench-moe-dense)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "models")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="dtype of the saved weights (bfloat16, as real checkpoints ship)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild models that already exist")
    args = parser.parse_args(argv)

    all_ok = True
    default = [name for name, model in BENCH_MODELS.items() if args.all or not name.startswith("bench-moe")]
    for name in args.only or sorted(default):
        out_dir = args.out_dir / name
        if is_complete(out_dir) and not args.force:
            log(f"{name}: {out_dir} exists, skipping (--force to rebuild)")
            continue
        build(BENCH_MODELS[name], out_dir, getattr(torch, args.dtype))
        all_ok &= check(BENCH_MODELS[name], out_dir)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
