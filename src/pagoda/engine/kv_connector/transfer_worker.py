"""The TcpConnector's worker side: the producer's block server and the consumer's pull (docs/disaggregation.md).

The wire, one pull per connection: the consumer sends one JSON line, `{"remote_request_id", "remote_block_ids",
"namespace", "first_block"}` (all the ids the producer named; it wants those from `first_block` on, holding the
ones before in its own prefix cache); the producer releases them all and answers one JSON line, `{"ok": true,
"num_blocks", "value_bytes"}` (or `{"ok": false, "error"}`), then per block its 32-byte prefix-cache hash and its
value in the offload tiers' format (block_format.py: layout and CRC32 in a header, then every layer's rows). The
namespace (keys.py: model, KV dtype and layout, kernels, block size) must be the producer's own, so an engine never
loads another model's KV.

The server copies the held blocks out of the pool on its own thread (they cannot change while held, see
transfer.HeldBlocks), releases them, then sends. The pull runs on a thread of the decode replica's event loop's
executor, before its request reaches the engine, writing each verified block to the receive buffer; the engine
keeps stepping meanwhile. A pull that fails partway keeps the blocks it got (a prefix of the prompt); the
request computes the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Collection, Sequence

import torch

from pagoda.engine.api import KVTierStats
from pagoda.engine.kv_connector.block_format import BlockLayout, BlockRefused, decode_block, encode_block
from pagoda.engine.kv_connector.counters import TierCounters
from pagoda.engine.kv_connector.keys import HASH_BYTES
from pagoda.engine.kv_connector.offload_worker import OffloadingWorker
from pagoda.engine.kv_connector.stores import LocalStore
from pagoda.engine.kv_connector.transfer import HeldBlocks
from pagoda.kv_transfer_params import KVTransferParams

logger = logging.getLogger(__name__)

TRANSFER_MEDIUM = "TCP"  # the counters of blocks moved over the wire: served (saved) on a producer, pulled (loaded)
# The receive buffer's: blocks loaded from it into the pool are a remote prefill's.
RECEIVED_MEDIUM = "REMOTE"
MAX_LINE_BYTES = 1 << 22  # a pull's request line: a block id list for a prompt of millions of tokens


class BlockServer:
    """The producer's server: a thread listening on (host, port), a thread per pull."""

    def __init__(self, host: str, port: int, held: HeldBlocks, tensors: Sequence[torch.Tensor], block_size: int,
                 layout: BlockLayout, namespace: bytes) -> None:
        self.held, self.tensors, self.block_size = held, list(tensors), block_size
        self.layout, self.namespace = layout, namespace
        self.counters = TierCounters(TRANSFER_MEDIUM)
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                server.serve(self.rfile, self.connection)

        self._server = socketserver.ThreadingTCPServer((host, port), Handler, bind_and_activate=False)
        self._server.daemon_threads = True
        self._server.allow_reuse_address = True
        self._server.server_bind()
        self._server.server_activate()
        self.host, self.port = host, int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="pagoda-kv-blocks", daemon=True)
        self._thread.start()

    def serve(self, rfile: object, connection: socket.socket) -> None:
        try:
            line = rfile.readline(MAX_LINE_BYTES)  # type: ignore[attr-defined]
            ask = json.loads(line)
            request_id, block_ids = str(ask["remote_request_id"]), [int(i) for i in ask["remote_block_ids"]]
            first_block = int(ask.get("first_block", 0))
            if first_block < 0:
                raise ValueError(f"first_block {first_block} is negative")
            if bytes.fromhex(str(ask["namespace"])) != self.namespace:
                return self._refuse(connection, "another model, KV layout or block size: not this engine's blocks")
        except (ValueError, KeyError, TypeError) as error:
            return self._refuse(connection, f"malformed pull: {error}")
        blocks = self.held.begin_serving(request_id, block_ids)
        if isinstance(blocks, str):
            return self._refuse(connection, blocks)
        started = time.perf_counter()
        try:
            values = [block_hash + encode_block(self.layout, self._copy_out(block_id))
                      for block_id, block_hash in blocks[first_block:]]
        finally:
            self.held.finish_serving(request_id)  # copied out: the pool may have them back
        header = {"ok": True, "num_blocks": len(values), "value_bytes": self.layout.value_bytes}
        try:
            connection.sendall(json.dumps(header).encode() + b"\n")
            for value in values:
                connection.sendall(value)
        except OSError as error:
            self.counters.add(failures=1)
            logger.warning("KV pull of %s: the decode side went away (%s)", request_id, error)
            return None
        self.counters.add(blocks_saved=len(values), bytes_saved=len(values) * self.layout.payload_bytes,
                          save_seconds=time.perf_counter() - started)
        return None

    def _copy_out(self, block_id: int) -> bytes:
        start = block_id * self.block_size
        return b"".join(tensor[start : start + self.block_size].contiguous().view(torch.uint8).numpy().tobytes()
                        for tensor in self.tensors)

    def _refuse(self, connection: socket.socket, error: str) -> None:
        self.counters.add(failures=1)
        with contextlib.suppress(OSError):
            connection.sendall(json.dumps({"ok": False, "error": error}).encode() + b"\n")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class BlockPuller:
    """The consumer's pull, into the receive buffer. Thread-safe (the buffer locks; the counters lock)."""

    def __init__(self, buffer: LocalStore, layout: BlockLayout, namespace: bytes, timeout_s: float) -> None:
        self.buffer, self.layout, self.namespace, self.timeout_s = buffer, layout, namespace, timeout_s
        self.counters = TierCounters(TRANSFER_MEDIUM)

    def pull(self, params: KVTransferParams, skip_blocks: int = 0) -> int:
        """Pulls the blocks `params` name, but the first `skip_blocks`, into the receive buffer; returns how many
        arrived (0 on failure: the request then computes its prompt; never raises). It connects even when it
        wants none of them: the producer then releases them at once instead of at its hold timeout."""
        if not params.remote_block_ids:
            return 0
        assert params.remote_host is not None and params.remote_port is not None
        started, received = time.perf_counter(), 0
        try:
            with socket.create_connection((params.remote_host, params.remote_port), timeout=self.timeout_s) as sock:
                ask = {"remote_request_id": params.remote_request_id, "remote_block_ids": list(params.remote_block_ids),
                       "namespace": self.namespace.hex(), "first_block": skip_blocks}
                sock.sendall(json.dumps(ask).encode() + b"\n")
                stream = sock.makefile("rb")
                answer = json.loads(stream.readline(MAX_LINE_BYTES) or b"{}")
                if not answer.get("ok"):
                    raise ConnectionError(answer.get("error", "the producer closed the connection"))
                value_bytes = int(answer["value_bytes"])
                for _ in range(int(answer["num_blocks"])):
                    block_hash = _read_exactly(stream, HASH_BYTES)
                    value = _read_exactly(stream, value_bytes)
                    decode_block(self.layout, value)  # checks layout and checksum before anything is stored
                    if not self.buffer.put(self.namespace + block_hash, value):
                        raise ConnectionError("the receive buffer refused a block")
                    received += 1
        except (OSError, ValueError, KeyError, BlockRefused) as error:
            self.counters.add(failures=1)
            logger.warning("KV pull from %s:%s got %d of %d blocks (%s): the rest is computed", params.remote_host,
                           params.remote_port, received, len(params.remote_block_ids) - skip_blocks, error)
        self.counters.add(hit_blocks=received, bytes_loaded=received * self.layout.payload_bytes,
                          load_seconds=time.perf_counter() - started)
        return received


def _read_exactly(stream: object, count: int) -> bytes:
    data = stream.read(count)  # type: ignore[attr-defined]
    if len(data) != count:
        raise ConnectionError(f"the producer closed the connection ({len(data)} of {count} bytes)")
    return bytes(data)


class TransferWorker:
    """The worker half: loads from the receive buffer (the offload worker's path), the server's and the pull's
    counters, and shutdown."""

    def __init__(self, loads: OffloadingWorker | None, server: BlockServer | None, puller: BlockPuller | None) -> None:
        self.loads, self.server, self.puller = loads, server, puller

    def start_load_kv(self, metadata: object) -> dict[str, int]:
        return {} if self.loads is None else self.loads.start_load_kv(metadata)

    def save_kv(self, metadata: object, skip: Collection[str] = ()) -> None:
        """Nothing is saved: a producer's blocks stay in its pool until pulled."""

    def wait_for_saves(self, timeout_s: float = 10.0) -> None:
        """No saves to wait for."""

    def tier_stats(self) -> list[KVTierStats]:
        moved = TierCounters(TRANSFER_MEDIUM)
        for part in (self.server, self.puller):
            if part is not None:
                snapshot = part.counters.snapshot()
                moved.add(**{name: value for name, value in dataclasses.asdict(snapshot).items() if name != "medium"})
        received = [] if self.loads is None else self.loads.tier_stats()
        return [moved.snapshot(), *received]

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.loads is not None:
            self.loads.shutdown()
