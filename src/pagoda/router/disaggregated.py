"""`pagoda route --pd-disaggregation`: each generation runs its prompt on a prefill replica and its answer on a
decode replica (docs/disaggregation.md).

vLLM's flow: the request goes to a prefill replica as it came, but with `max_tokens` 1, one choice, no stream and
`kv_transfer_params: {"do_remote_decode": true}`; that replica computes the prompt, holds its KV and answers
where to pull it (`kv_transfer_params` in its response). The request then goes, as the client sent it, to a
decode replica with those kv_transfer_params: it pulls the prompt's blocks, computes the last prompt token
and streams the answer to the client. Each pool has its own Router (choice, load, breaker, retries): a dead
prefill replica is routed around; with none left, or any failure of the prefill step, the decode replica
computes the prompt itself, so a request is never lost to the split.

Only a single-prompt completion or chat completion is split; everything else (several prompts, the Responses
API, embeddings) goes to the decode pool whole.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import Response

from pagoda.router.policies import RoutedPrompt
from pagoda.router.proxy import Forwarder
from pagoda.router.replica import Replica
from pagoda.router.tenancy import TenantMeter

logger = logging.getLogger("pagoda.route")

SPLIT_PATHS = ("/v1/completions", "/v1/chat/completions")
# What the prefill step does not need: it samples one token, thrown away, and answers whole.
PREFILL_DROPPED = ("stream", "stream_options", "n", "best_of", "min_tokens", "stop", "max_completion_tokens",
                   "logprobs", "top_logprobs", "kv_transfer_params")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill replica's request: the same prompt (every field that shapes it kept), one token, held KV."""
    prefill = {key: value for key, value in body.items() if key not in PREFILL_DROPPED}
    prefill["max_tokens"] = 1
    prefill["kv_transfer_params"] = {"do_remote_decode": True}
    return prefill


def splits(path: str, body: dict[str, Any]) -> bool:
    """Is this a request the split serves: one prompt's completion or chat completion?"""
    if path not in SPLIT_PATHS:
        return False
    if path == "/v1/completions":
        prompt = body.get("prompt")
        # A list of strings or of token lists is several prompts; a list of ints is one prompt's tokens.
        return isinstance(prompt, str) or (isinstance(prompt, list) and (
            len(prompt) == 1 or all(isinstance(token, int) for token in prompt)))
    return True


class DisaggregatedForwarder:
    """Forwarder's interface over two pools: `prefill` computes prompts, `decode` answers."""

    def __init__(self, prefill: Forwarder, decode: Forwarder) -> None:
        self.prefill = prefill
        self.decode = decode

    async def dispatch(self, path: str, body: bytes, headers: dict[str, str], prompt: RoutedPrompt,
                       stream: bool, pinned: Replica | None = None, meter: TenantMeter | None = None) -> Response:
        """meter: the request's tenant, charged by the answer (the prefill step's one token is not its)."""
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if pinned is not None or not isinstance(parsed, dict) or not splits(path, parsed):
            return await self.decode.dispatch(path, body, headers, prompt, stream, pinned, meter)
        transfer = await self._prefill(path, parsed, headers, prompt)
        if transfer is not None:
            body = json.dumps({**parsed, "kv_transfer_params": transfer}).encode()
        return await self.decode.dispatch(path, body, headers, prompt, stream, meter=meter)

    async def _prefill(self, path: str, parsed: dict[str, Any], headers: dict[str, str],
                       prompt: RoutedPrompt) -> dict[str, Any] | None:
        """The prefill replica's kv_transfer_params, or None when the prefill step failed in any way (the decode
        replica then computes the prompt, and answers a bad request's error itself)."""
        answer = await self.prefill.dispatch(path, json.dumps(prefill_request(parsed)).encode(), headers, prompt,
                                             stream=False)
        if answer.status_code != 200:
            logger.info("prefill step answered %d: the decode replica computes the prompt", answer.status_code)
            return None
        try:
            transfer = json.loads(bytes(answer.body)).get("kv_transfer_params")
        except (ValueError, AttributeError):
            transfer = None
        if not isinstance(transfer, dict) or not transfer.get("do_remote_prefill"):
            logger.warning("the prefill replica answered without kv_transfer_params (is it serving with "
                           "--kv-transfer-config's TcpConnector as kv_producer?): the decode replica computes")
            return None
        return transfer
