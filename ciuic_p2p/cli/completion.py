"""``ciuic-node completion bash|zsh``: a shell completion script generated from the
parser tree, so that it never lags the commands.

    source <(ciuic-node completion bash)     # in ~/.bashrc
    source <(ciuic-node completion zsh)      # in ~/.zshrc (through bashcompinit)

The script knows, for each command path (``ciuic-node store``), its subcommands and
positional choices, its options, and the choices of each option that has some
(``run --log-level``). The zsh script is the bash one under zsh's ``bashcompinit``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

PROG = "ciuic-node"
SHELLS = ("bash", "zsh")


def add_completion_command(sub: Any) -> None:
    text = "print a shell completion script (bash or zsh) for ciuic-node"
    cmd = sub.add_parser(
        "completion",
        help=text,
        description=(
            "Print a completion script for SHELL, generated from the commands: add "
            "`source <(ciuic-node completion bash)` to ~/.bashrc, or the zsh line to "
            "~/.zshrc."
        ),
    )
    cmd.add_argument("shell", metavar="SHELL", choices=SHELLS, help="bash or zsh")


@dataclass
class Completions:
    """What the shell may complete: per command path, its words and its options;
    per (path, option), the option's choices."""

    words: dict[str, list[str]] = field(default_factory=dict)
    options: dict[str, list[str]] = field(default_factory=dict)
    choices: dict[str, list[str]] = field(default_factory=dict)


def completions(parser: argparse.ArgumentParser, path: str = PROG) -> Completions:
    """The parser tree flattened (``path`` the command path of ``parser``)."""
    out = Completions()
    _walk(parser, path, out)
    return out


def _walk(parser: argparse.ArgumentParser, path: str, out: Completions) -> None:
    words: list[str] = []
    options: list[str] = []
    for action in parser._actions:  # argparse offers no public walk of its tree
        if action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                words.append(name)
                _walk(child, f"{path} {name}", out)
        elif action.option_strings:
            options += action.option_strings
            if action.choices:
                for flag in action.option_strings:
                    out.choices[f"{path} {flag}"] = [str(c) for c in action.choices]
        elif action.choices:
            words += [str(c) for c in action.choices]
    out.words[path] = words
    out.options[path] = options


def bash_script(parser: argparse.ArgumentParser) -> str:
    c = completions(parser)

    def table(name: str, rows: dict[str, list[str]]) -> str:
        lines = [f'    ["{key}"]="{" ".join(values)}"' for key, values in sorted(rows.items())]
        return f"declare -gA {name}=(\n" + "\n".join(lines) + "\n)\n"

    return (
        f"# {PROG} completion for bash: source <({PROG} completion bash)\n"
        + table("_ciuic_node_words", c.words)
        + table("_ciuic_node_options", c.options)
        + table("_ciuic_node_choices", c.choices)
        + """_ciuic_node() {
    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"
    local path="ciuic-node" i w
    # The command path: the words so far that name a subcommand of the path before.
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${COMP_WORDS[i]}"
        [[ -n "${_ciuic_node_words["$path $w"]+set}" ]] && path="$path $w"
    done
    if [[ -n "${_ciuic_node_choices["$path $prev"]+set}" ]]; then
        COMPREPLY=($(compgen -W "${_ciuic_node_choices["$path $prev"]}" -- "$cur"))
    elif [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "${_ciuic_node_options["$path"]}" -- "$cur"))
    else
        COMPREPLY=($(compgen -W "${_ciuic_node_words["$path"]}" -- "$cur"))
        [[ ${#COMPREPLY[@]} -eq 0 ]] && COMPREPLY=($(compgen -f -- "$cur"))
    fi
}
complete -F _ciuic_node ciuic-node
"""
    )


def zsh_script(parser: argparse.ArgumentParser) -> str:
    return (
        f"# {PROG} completion for zsh: source <({PROG} completion zsh)\n"
        "autoload -U +X bashcompinit && bashcompinit\n" + bash_script(parser).split("\n", 1)[1]
    )


def completion_main(parser: argparse.ArgumentParser, shell: str) -> int:
    sys.stdout.write(bash_script(parser) if shell == "bash" else zsh_script(parser))
    return 0
