"""Tenants at the router (`pagoda route --tenant-config`, and the front of `pagoda serve --data-parallel-size`):
one door (pagoda/tenant_door.py) for the whole fleet, so a tenant's requests and tokens per minute are counted
once, whichever replica serves them.

The router admits a request (403, 429) before routing it, charges its prompt tokens then (its own count: the
replicas' tokens with --tokenizer), and settles them, with the generated tokens, from what the answer says: a
whole answer's `usage`, a stream's events as they pass (one token an event) and its `usage` if it ends with one.
The request goes on to the replica with its Authorization and the tenants file's header unchanged, so a replica
given the same file finds the same tenant (its weight, adapters, prefix-cache namespace, KV quota); run such
replicas with `--no-tenant-rate-limits`, or each counts its own share again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagoda.router.policies import RoutedPrompt
from pagoda.tenant_door import TenantPass, Tenants

PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
GENERATED_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
SSE_EVENT = b"data:"
SSE_DONE = b"data: [DONE]"


@dataclass
class TenantMeter:
    """One admitted request's tokens, charged to its tenant as the router learns them."""

    tenant_pass: TenantPass
    prompt_tokens: int = 0
    generated_tokens: int = 0
    _usage_seen: bool = field(default=False, repr=False)

    def start(self, prompt: RoutedPrompt) -> None:
        """Charges the prompt as the router counted it, and keys its blocks in the tenant's cache namespace
        (as the replica will: the cache-aware policy then matches the replica's own blocks)."""
        self.prompt_tokens = prompt.num_tokens
        self.tenant_pass.charge(self.prompt_tokens, "prompt")
        prompt.cache_salt = self.tenant_pass.tenant.cache_salt(prompt.cache_salt)

    def observe(self, content: bytes, streamed: bool) -> None:
        """An answer, or a stream's next chunk: its events count a token each until a `usage` says exactly."""
        if streamed and not self._usage_seen:
            events = content.count(SSE_EVENT) - content.count(SSE_DONE)
            if events > 0:
                self.generated_tokens += events
                self.tenant_pass.charge(events, "generation")
        prompt, generated = PROMPT_TOKENS.search(content), GENERATED_TOKENS.search(content)
        if generated is not None:
            self._usage_seen = True
            self._settle("generation", int(generated.group(1)))
        if prompt is not None:
            self._settle("prompt", int(prompt.group(1)))

    def _settle(self, kind: str, total: int) -> None:
        charged = self.prompt_tokens if kind == "prompt" else self.generated_tokens
        if total > charged:  # a count the router made too low is made up; one too high is left (never refunded)
            self.tenant_pass.charge(total - charged, kind)
            if kind == "prompt":
                self.prompt_tokens = total
            else:
                self.generated_tokens = total

    def headers(self) -> dict[str, str]:
        return self.tenant_pass.headers()


def enter(tenants: Tenants | None, headers: Mapping[str, str], model: object,
          adapters: frozenset[str]) -> TenantMeter | None:
    """The request's tenant, admitted (raises the 403 or 429 OpenAIError otherwise); None: nobody's, or the
    router has no tenants. `model` names an adapter when a replica lists it as one."""
    if tenants is None or not tenants.configured:
        return None
    adapter = model if isinstance(model, str) and model in adapters else None
    tenant_pass = tenants.enter(headers, adapter)
    return TenantMeter(tenant_pass) if tenant_pass is not None else None
