"""LoRA adapters on a model split across 2 tensor-parallel ranks. Each rank holds its share of every adapter: the
rows of B its column-parallel projections compute (q/k/v, gate/up), the columns of A its row-parallel ones read
(o, down), whose partial shrinks the ranks add up before B. Greedy fp32 output of a mixed batch (the base model
and three adapters of different ranks and targets, one rsLoRA) equals transformers + PEFT token for token: split
KV heads (llama), one KV head on both ranks (llama-mqa), biases on q/k/v (qwen2), sandwich norms and capped
scores over two KV cache groups (gemma2), under chunked prefill with preemption and from the prefix cache.
Phi-3's fused projections: test_lora_phi3.py. Divergence only at a near-tie (conftest.compare_with_reference)."""

from __future__ import annotations

import pytest
from test_lora import PROMPTS, adapters, check_against_peft, greedy, mixed_requests  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(600)

ARCHS = ["llama", "llama-mqa", "qwen2", "gemma2"]
MODES = {
    # Chunks of 7 tokens in 16 blocks of 4: chunks share steps with decodes, and requests are preempted.
    "chunked+preemption": dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=7),
    # The same batch twice: the second time, every request's full blocks come from the prefix cache.
    "prefix-cached": dict(block_size=4, num_kv_blocks=256),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_mixed_batch_matches_peft(arch, mode, checkpoint, adapters, make_llm):  # noqa: F811 (the fixture)
    base, paths = checkpoint(arch), adapters(arch)
    options = dict(MODES[mode])
    if arch == "gemma2" and mode != "prefix-cached":  # two KV groups share the pool: more blocks
        options["num_kv_blocks"] *= 2
    requests = mixed_requests(paths)
    with make_llm(base, tensor_parallel_size=2, enable_lora=True, max_loras=3, max_cpu_loras=3, **options) as llm:
        assert llm.engine.executor.tensor_parallel_size == 2
        if mode == "prefix-cached":
            llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=requests)
        outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=requests)
        scheduler = llm.engine.scheduler
        if mode == "prefix-cached":
            assert all(o.num_cached_tokens == (len(p) - 1) // 4 * 4 for o, p in zip(outputs, PROMPTS))
        else:
            assert scheduler.num_preemptions > 0
    check_against_peft(base, paths, requests, outputs, f"{arch}/{mode}/TP=2")
