"""Every default a flag's help shows is read from the class that holds it (pagoda.config, ServerLimits,
RouterConfig, GrammarLimits), never written a second time: a default changed there shows in `--help`.
And `--help` answers without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda.cli import build_parser
from pagoda.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pagoda.flag_values import format_bytes, parse_bytes
from pagoda.int4_format import Int4Options
from pagoda.router.config import RouterConfig
from pagoda.structured.limits import GrammarLimits
from pagoda.wire.limits import ServerLimits


def command_help(command: str) -> str:
    """`pagoda COMMAND --help`, with the line wrapping undone."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    return " ".join(commands.choices[command].format_help().split())


# (class, field, a value no default has, how help shows it): one per flag whose help states its default.
ENGINE_DEFAULTS = [
    (EngineConfig, "dtype", "bfloat16", "(default bfloat16)"),
    (EngineConfig, "device", "meta", "default meta"),
    (EngineConfig, "use_kernels", False, "where they apply (default off)"),
    (EngineConfig, "seed", 4242, "default 4242"),
    (SchedulerConfig, "max_model_len", 4243, "default 4243"),
    (SchedulerConfig, "max_num_seqs", 4244, "default 4244"),
    (SchedulerConfig, "max_num_batched_tokens", 4245, "default 4245"),
    (SchedulerConfig, "max_step_ms", 123.5, "(default 123.5; 0: no cap"),
    (SchedulerConfig, "long_prefill_token_threshold", 77, "(default 77; 0: no cap)"),
    (SchedulerConfig, "scheduling_policy", "priority", "lower first (default priority)"),
    (SchedulerConfig, "priority_aging_s", 2.5, "(default 2.5; 0: strict order"),
    (CacheConfig, "block_size", 4246, "default 4246"),
    (CacheConfig, "kv_cache_memory_bytes", 3 << 20, "default 3M)"),
    (CacheConfig, "enable_prefix_caching", False, "--no-enable-prefix-caching default off"),
    (Int4Options, "group_size", 128, '"group_size": 128'),
    (GrammarLimits, "max_repeat", 4247, "(default 4247)"),
    (ParallelConfig, "tensor_parallel_size", 4253, "(default 4253;"),
]


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
@pytest.mark.parametrize(("config", "name", "value", "shown"), ENGINE_DEFAULTS,
                         ids=[f"{c.__name__}.{n}" for c, n, _, _ in ENGINE_DEFAULTS])
def test_engine_flags_show_the_config_default(monkeypatch, command, config, name, value, shown):
    assert shown not in command_help(command)
    monkeypatch.setattr(config, name, value)
    assert shown in command_help(command)


SERVER_DEFAULTS = [
    ("max_request_body_bytes", 5 << 20, "(suffixes K, M, G; default 5M)"),
    ("max_chars_per_token", 7.5, "before tokenizing it (default 7.5)"),
    ("max_sequences_per_request", 4248, "(default 4248)"),
    ("max_stop_strings", 4249, "(default 4249)"),
    ("max_stop_string_chars", 4250, "(default 4250)"),
    ("max_logit_bias", 4251, "(default 4251)"),
    ("request_timeout", 99.0, "(default 99; 0: no limit)"),
    ("request_read_timeout", 3.5, "closed (default 3.5)"),
]


@pytest.mark.parametrize(("name", "value", "shown"), SERVER_DEFAULTS, ids=[n for n, _, _ in SERVER_DEFAULTS])
def test_request_bounds_show_the_server_limits_default(monkeypatch, name, value, shown):
    assert shown not in command_help("serve")
    monkeypatch.setattr(ServerLimits, name, value)
    assert shown in command_help("serve")


def test_every_router_flag_shows_the_router_config_default(monkeypatch):
    from pagoda.router.cli import CONFIG_FLAGS

    for flag, (name, kind, _) in CONFIG_FLAGS.items():
        value = "round_robin" if name == "policy" else kind(4252)
        monkeypatch.setattr(RouterConfig, name, value)
        help_text = command_help("route")
        after_flag = help_text[help_text.index(f"{flag} ", help_text.index("options:")):]
        assert f"(default {value if name == 'policy' else 4252})" in after_flag[:300], flag


@pytest.mark.parametrize("count", [8 << 20, 2 << 30, 512 << 10, 1000, 3 * (1 << 30) // 2])
def test_byte_counts_read_back_as_written(count):
    assert parse_bytes(format_bytes(count)) == count


def test_building_the_parser_imports_neither_torch_nor_the_web_stack_and_help_no_torch():
    """Every command builds the whole parser; only `serve --help` reads ServerLimits (and so pydantic)."""
    code = ("import sys, pagoda.cli\n"
            "pagoda.cli.build_parser()\n"
            "print(sorted(m for m in ('torch', 'fastapi', 'pydantic') if m in sys.modules))\n"
            "for command in ('serve', 'generate', 'chat', 'route'):\n"
            "    try:\n"
            "        pagoda.cli.main([command, '--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[0] == "[]"
    assert result.stdout.strip().splitlines()[-1] == "False"
