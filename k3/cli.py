"""The `k3` command line: `k3 <command> [args]`.

Each command lives in its own module, imported only when that command runs, so `k3 --help` is fast and
importing this file pulls in no torch. A command module provides

    add_arguments(parser: argparse.ArgumentParser) -> None     # its options; may set parser.description
    run(args: argparse.Namespace) -> int | None                # does the work; returns the exit code

and is registered with one line in COMMANDS below. A ValueError raised by a command is a user error: it
prints `k3: error: <message>` to stderr and exits with code 2 (argparse's code for usage errors), without
a traceback.
"""

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    module: str  # provides add_arguments(parser) and run(args)
    help: str


COMMANDS: tuple[Command, ...] = (
    Command("params", "k3.params", "count total and active parameters of a config, by component"),
    Command("train", "k3.train.cli", "train a K3 model (default: k3-mini on the stdlib, 10 minutes on CPU)"),
    Command("eval", "k3.train.cli", "validation loss and bits per byte of a checkpoint"),
    Command("sample", "k3.train.cli", "sample text from a checkpoint"),
    Command("sft", "k3.train.sft", "supervised fine-tuning on conversations from a run, QAT from step 0"),
    Command("eval-agent", "k3.agent.evaluate", "score a chat model as a tool-calling agent through k3 serve"),
    Command("ablate", "k3.train.cli", "train K3 recipe variants at equal tokens and seeds; table + plot"),
    Command("plan", "k3.capacity", "per-GPU memory plan for training and serving a config on G GPUs"),
    Command("export", "k3.export.cli", "export a checkpoint: the release layout (hf) or a llama.cpp GGUF"),
    Command("serve", "k3.serve.cli", "OpenAI-compatible HTTP server on the inference engine"),
    Command("chat", "k3.serve.chat", "interactive terminal chat on the inference engine"),
    Command("generate", "k3.infer.generate_cli", "complete a prompt or an arbitrarily long prompt file"),
    Command("quantize", "k3.quant.cli", "convert a checkpoint's routed experts to MXFP4 (post-training)"),
    Command("bench", "k3.benchmark.cli", "run the benchmark suite: JSON, markdown table and plots"),
)


def _top_parser() -> argparse.ArgumentParser:
    from k3 import __version__

    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 in PyTorch.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"k3 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS:  # the command's own arguments are parsed later, by its module's parser
        sub.add_parser(cmd.name, help=cmd.help, add_help=False)
    return parser


def _command_parser(cmd: Command):
    """(parser, module) for one command; imports the command's module."""
    module = importlib.import_module(cmd.module)
    parser = argparse.ArgumentParser(prog=f"k3 {cmd.name}", description=cmd.help, allow_abbrev=False)
    module.add_arguments(parser)
    return parser, module


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of the command `name` (imports its module); ValueError for an unknown name."""
    cmd = next((c for c in COMMANDS if c.name == name), None)
    if cmd is None:
        raise ValueError(f"unknown command {name!r}; one of: {', '.join(c.name for c in COMMANDS)}")
    return _command_parser(cmd)[0]


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse a command line (without the leading `k3`) as `main` would, without running the command.

    argparse's usage errors raise SystemExit as usual. tests/test_docs.py feeds it every `k3 ...` line
    of the docs, so a renamed or removed flag fails there.
    """
    top, rest = _top_parser().parse_known_args(argv)
    return command_parser(top.command).parse_args(rest)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `k3` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        top, rest = _top_parser().parse_known_args(argv)
        cmd = next(c for c in COMMANDS if c.name == top.command)
        parser, module = _command_parser(cmd)
        args = parser.parse_args(rest)
        try:
            code = module.run(args)
        except ValueError as e:
            print(f"k3: error: {e}", file=sys.stderr)
            return 2
        return 0 if code is None else int(code)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
