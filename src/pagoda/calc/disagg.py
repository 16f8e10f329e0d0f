"""`pagoda calc --disagg`: the prefill/decode split's handoff, and whether it pays (docs/calc.md).

The handoff is what the TcpConnector moves (docs/disaggregation.md): a prompt's full blocks before the block of
its last prompt token, less the blocks the decode replica's prefix cache already holds. Its bytes are
`formulas.handoff_bytes`: `kv_bytes_per_token` times the tokens moved, the same figure a decode replica's
`vllm:kv_offload_total_bytes{transfer_type="TCP_to_GPU"}` counts, so a measurement can be set beside it.
"""

from __future__ import annotations

from pagoda.calc import formulas as f
from pagoda.calc.deployment import Deployment, prefill_seconds
from pagoda.calc.render import Section

# Below this share of a colocated replica's time spent on prefill, its decodes are rarely stalled and a second
# pool would mostly idle: the split is worth its transfers only for traffic heavier in prompts than this.
MIN_PREFILL_SHARE = 0.1


def disagg_section(d: Deployment, link_gbps: float, output_len: int, request_rate: float) -> Section:
    inputs = d.inputs
    assert d.kv_bytes_per_token is not None, "the split's figures need the model's KV shape"
    prompt, block = inputs.prompt_len, inputs.block_size
    local = inputs.prefix_len or 0
    blocks = f.handoff_blocks(prompt, block, local)
    moved = f.handoff_bytes(prompt, block, d.kv_bytes_per_token, local)
    transfer_s = moved / (link_gbps * 1e9)
    # What the decode side no longer computes: the moved tokens' prefill, its cheapest part (the last block's
    # forward still reads every weight once, as it would have anyway).
    saved_s = prefill_seconds(d, blocks * block, include_weight_reads=False)
    prefill_s = prefill_seconds(d, prompt)
    prefill_share = request_rate * prefill_s
    link_share = request_rate * transfer_s
    moves_faster = transfer_s < saved_s
    pays = moves_faster and link_share < 1 and prefill_share >= MIN_PREFILL_SHARE
    s = Section("disagg", f"Prefill/decode split ({prompt:,} tok prompt, {output_len:,} out, "
                          f"{request_rate:g} req/s, {link_gbps:g} GB/s link)")
    s.add("handoff_blocks", "blocks moved per request", blocks,
          note=f"full blocks before the last prompt token's, less {local // block * block:,} tok cached on decode"
          if local else "full blocks before the last prompt token's")
    s.add("handoff_tokens", "tokens moved per request", blocks * block)
    s.add("handoff_bytes", "KV moved per request", moved, "bytes", "blocks x block size x KV per token")
    s.add("transfer_s", "transfer time per request", transfer_s, "s", "bytes / link bandwidth")
    s.add("prefill_saved_s", "prefill saved on the decode side", saved_s, "s", "the moved tokens' flops")
    s.add("moves_faster_than_recompute", "moving beats recomputing", moves_faster)
    s.add("prompt_to_output_ratio", "prompt / output tokens", prompt / output_len)
    s.add("prefill_share", "colocated: share of time in prefill", prefill_share, "%",
          "rate x prefill time: steps whose decodes stall behind a prompt")
    s.add("link_share", "link busy", link_share, "%", "rate x transfer time")
    s.add("split_pays", "the split pays", pays,
          f"moving beats recomputing, the link keeps up, and prefill takes >= {MIN_PREFILL_SHARE:.0%} of a "
          "colocated replica's time")
    return s
