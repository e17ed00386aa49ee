"""The `dflash` command. Each subcommand lives in its own module, exposing
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when used."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare-model": ("runtime.prepare.cli", "download and convert a real model into the models home"),
    "make-draft": ("services.draft.make_random", "create a random-initialised DFlash drafter for a target"),
    "up": ("gateway.launcher", "start target, draft and gateway on this machine"),
    "demo": ("gateway.demo", "start the local stack and run a short chat through the OpenAI API"),
    "train-draft": ("services.draft.training.cli", "train a DFlash drafter for a target"),
    "eval-draft": ("services.draft.training.evaluate", "measure a drafter's acceptance length"),
    "build-prompts": ("services.draft.training.prompts", "build the offline prompt set"),
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
