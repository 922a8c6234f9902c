"""`pagedq --help` reads as a user's guide: the commands a user starts with come first,
every command has a description and every flag says what it does (not only which
PAGEDQ_* variable it sets), `worker --help` describes the worker's own flags, and a model
hub id given as --model says how to get a local checkpoint."""

from __future__ import annotations

import argparse

from pagedq.cli import build_parser, main


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
