"""vLLM's `kv_transfer_params`, the request and response field of prefill/decode disaggregation
(docs/disaggregation.md).

The flow, as vLLM's proxy runs it: the prompt goes to a prefill replica with `{"do_remote_decode": true}` and
`max_tokens` 1; that replica answers with `{"do_remote_prefill": true, "remote_engine_id", "remote_request_id",
"remote_block_ids", "remote_host", "remote_port"}`, which the router puts on the same request sent to a decode
replica, which pulls those blocks instead of computing the prompt. Torch-free neutral ground: the wire, the
engine's connector and the router read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FIELD = "kv_transfer_params"
KEYS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_block_ids",
        "remote_host", "remote_port", "tp_size")
MAX_REMOTE_BLOCKS = 1 << 20


class InvalidParam(ValueError):
    """A malformed kv_transfer_params: `param` names the field for OpenAI's 400 (as sampling.InvalidParam does)."""

    def __init__(self, param: str, requirement: str) -> None:
        super().__init__(f"{param} {requirement}")
        self.param = param


@dataclass(frozen=True)
class KVTransferParams:
    do_remote_decode: bool = False  # to a prefill replica: keep this prompt's KV for a decode replica to pull
    do_remote_prefill: bool = False  # to a decode replica: pull the prompt's KV from where the fields below say
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: tuple[int, ...] = ()
    remote_host: str | None = None
    remote_port: int | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> KVTransferParams:
        """Raises InvalidParam naming kv_transfer_params for a key pagoda does not take or a value of the wrong
        kind."""
        if not isinstance(values, Mapping):
            raise InvalidParam(FIELD, "must be a JSON object")
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise InvalidParam(FIELD, f"has unsupported key(s) {', '.join(unknown)}; pagoda takes {', '.join(KEYS)}")
        for flag in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(values.get(flag, False), bool):
                raise InvalidParam(FIELD, f"{flag} must be true or false")
        if values.get("tp_size", 1) != 1:
            raise InvalidParam(FIELD, "tp_size must be 1: the KV connector does not run with tensor parallelism")
        params = cls(
            do_remote_decode=bool(values.get("do_remote_decode", False)),
            do_remote_prefill=bool(values.get("do_remote_prefill", False)),
            remote_engine_id=_optional_str(values, "remote_engine_id"),
            remote_request_id=_optional_str(values, "remote_request_id"),
            remote_block_ids=_block_ids(values.get("remote_block_ids")),
            remote_host=_optional_str(values, "remote_host"),
            remote_port=_port(values.get("remote_port")),
        )
        if params.do_remote_decode and params.do_remote_prefill:
            raise InvalidParam(FIELD, "do_remote_decode and do_remote_prefill exclude each other")
        if params.do_remote_prefill and (params.remote_host is None or params.remote_port is None
                                         or params.remote_request_id is None):
            raise InvalidParam(FIELD, "do_remote_prefill needs remote_host, remote_port and remote_request_id")
        return params

    def as_dict(self) -> dict[str, Any]:
        """vLLM's shape, as a prefill replica's response carries it."""
        return {"do_remote_decode": self.do_remote_decode, "do_remote_prefill": self.do_remote_prefill,
                "remote_engine_id": self.remote_engine_id, "remote_request_id": self.remote_request_id,
                "remote_block_ids": list(self.remote_block_ids), "remote_host": self.remote_host,
                "remote_port": self.remote_port, "tp_size": 1}


def _optional_str(values: Mapping[str, Any], key: str) -> str | None:
    value = values.get(key)
    if value is not None and (not isinstance(value, str) or not value or len(value) > 256):
        raise InvalidParam(FIELD, f"{key} must be a non-empty string of at most 256 characters")
    return value


def _block_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_REMOTE_BLOCKS or \
            not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise InvalidParam(FIELD, "remote_block_ids must be a list of block ids (integers >= 0)")
    return tuple(value)


def _port(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
        raise InvalidParam(FIELD, "remote_port must be a TCP port in [1, 65535]")
    return value
