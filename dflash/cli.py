"""The `dflash` command. Each subcommand lives in its own module, exposing
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when used."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare-model": ("dflash.prepare.cli", "download and convert a real model into the models home"),
    "make-draft": ("dflash.make_draft", "create a random-initialised DFlash drafter for a target"),
    "up": ("dflash.up", "start target, draft and gateway on this machine"),
    "demo": ("dflash.demo", "start the local stack and run a short chat through the OpenAI API"),
    "train-draft": ("train.cli", "train a DFlash drafter for a target"),
    "eval-draft": ("train.evaluate", "measure a drafter's acceptance length"),
    "draft-vocab": ("train.draft_vocab", "rank the tokens a drafter proposes from (the target's answers)"),
    "build-prompts": ("train.prompts", "build the offline prompt set"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"dflash {name}", description=COMMANDS[name][1])
    module.add_arguments(cmd_parser)
    return int(module.run(cmd_parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
