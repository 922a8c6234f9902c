"""`pagedq --help` reads as a user's guide: the commands a user starts with come first,
every command has a description and every flag says what it does (not only which
PAGEDQ_* variable it sets), `worker --help` describes the worker's own flags, and a model
hub id given as --model says how to get a local checkpoint."""

from __future__ import annotations

import argparse
import subprocess
import sys

from pagedq.cli import REGISTRATIONS, build_parser, main


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("pagedq",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from commands(sub, (*path, name))


def test_help_starts_with_up_submit_batch_and_describes_every_command_and_flag(capsys):
    parser = build_parser()
    assert [name for (_, name), _ in ((p, s) for p, s in commands(parser) if len(p) == 2)][:3] == ["up", "submit", "batch"]
    assert "summary per document" in parser.format_help() and "own module" not in parser.format_help()
    undescribed = [" ".join(path) for path, sub in commands(parser) if not sub.description]
    unexplained = [f"{' '.join(path)} {action.option_strings or action.dest}" for path, sub in commands(parser)
                   for action in sub._actions
                   if not isinstance(action, argparse._SubParsersAction)
                   and (not action.help or action.help.startswith("PAGEDQ_"))]
    assert undescribed == [] and unexplained == []
    worker = dict(commands(parser))[("pagedq", "worker")]
    options = {option: action for action in worker._actions for option in action.option_strings}
    assert "--port" not in options and "metrics" in options["--host"].help


def test_a_model_hub_id_says_to_pull_a_local_checkpoint(capsys):
    assert main(["up", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 1
    err = capsys.readouterr().err
    assert "looks like a model hub id" in err and "`pagedq pull`" in err and "Traceback" not in err


def test_each_registration_adds_the_commands_it_lists():
    """REGISTRATIONS' lists are what main() reads to import one command's module alone."""
    for module, function, listed in REGISTRATIONS:
        parser = argparse.ArgumentParser()
        subparsers = parser.add_subparsers()
        getattr(__import__(module, fromlist=[function]), function)(subparsers)
        assert tuple(subparsers.choices) == listed, module
    everything = [name for _, _, listed in REGISTRATIONS for name in listed]
    assert len(everything) == len(set(everything))


def test_a_service_process_does_not_import_the_benchmarks_http_clients():
    """`pagedq api` / `pagedq worker` parse their arguments without the bench and batch
    commands' modules (aiohttp, httpx: a fraction of a second of every start); `pagedq
    --help` and an unknown command still see every command."""
    probe = ("import sys; from pagedq.cli import build_parser; "
             "build_parser('worker').parse_args(['worker', '--queue-name', 'q']); "
             "print(sorted(m for m in ('aiohttp', 'httpx', 'pagedq.client', 'pagedq.commands.bench') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    every = {name for _, _, listed in REGISTRATIONS for name in listed}
    for command in (None, "nosuch"):
        assert set(next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction)).choices) == every
