"""`pagoda lab NAME [--quick] [--model DIR] [--out DIR]` and `pagoda lab --list`."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from pagoda.labs.registry import LABS
from pagoda.labs.result import write_json, write_plot


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "lab", help="sweep one knob of a real engine, with calc's prediction beside each measurement",
        description="Runs a lab: one knob of an in-process engine swept, calc's prediction beside each "
                    "measurement, a table, a JSON file and a plot (docs/labs.md).")
    parser.add_argument("name", nargs="?", choices=sorted(LABS), help="the lab to run")
    parser.add_argument("--list", action="store_true", help="list the labs and their questions")
    parser.add_argument("--quick", action="store_true", help="a short sweep, under a minute on 2 cores")
    parser.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--out", type=Path, default=Path("."), help="where NAME.json and NAME.png go (default .)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.list or args.name is None:
        for name, lab in LABS.items():
            print(f"{name:14} {lab.QUESTION}")
        return 0
    from pagoda.engine_args import model_to_load

    lab = LABS[args.name]
    model = model_to_load(args.model, "lab")
    print(f"{args.name}: {lab.QUESTION}", flush=True)
    result = lab.run(model, args.quick)
    print(result.table())
    print(f"\n{result.lesson}")
    print(f"lesson {'holds' if result.lesson_holds else 'DOES NOT HOLD'} on this run")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(result, args.out / f"{args.name}.json")
    if importlib.util.find_spec("matplotlib") is not None:
        write_plot(result, lab.plot, args.out / f"{args.name}.png")
    else:
        print("no plot: matplotlib is not installed (pip install 'pagoda[bench]')", file=sys.stderr)
    return 0 if result.lesson_holds else 1
