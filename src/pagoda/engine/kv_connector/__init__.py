"""KV connectors (vLLM v1's shape): the scheduler side (engine/core/kv_connector.py's protocol) and the worker
side that moves blocks between the KV pool and external stores. docs/kv-offload.md."""
